"""Writes for models, pools and replicas."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from redis.exceptions import RedisError

from controlplane.redis import redis_sync
from inference.catalog import adapters_held_key, catalog_publish, pool_prefix
from inference.models import Model, Pool, Replica, name_validator

log = logging.getLogger(__name__)


@transaction.atomic
def model_ensure(
    *,
    name: str,
    served_name: str,
    context_length: int,
    supports_lora: bool = False,
    architecture: dict[str, Any] | None = None,
) -> Model:
    name_validator(name)  # no '/': that addresses tenants' adapters
    defaults: dict[str, Any] = {
        "served_name": served_name,
        "context_length": context_length,
        "supports_lora": supports_lora,
    }
    if architecture is not None:
        defaults["architecture"] = architecture
    model, _ = Model.objects.update_or_create(name=name, defaults=defaults)
    transaction.on_commit(catalog_publish)
    return model


@transaction.atomic
def pool_ensure(*, name: str, kind: str, model: Model, replica_urls: list[str]) -> Pool:
    """Create or update a pool and make its replica set exactly ``replica_urls``."""
    urls = [url.rstrip("/") for url in replica_urls]
    pool, _ = Pool.objects.update_or_create(name=name, defaults={"kind": kind, "model": model})
    pool.replicas.exclude(url__in=urls).delete()
    for url in urls:
        Replica.objects.get_or_create(pool=pool, url=url)
    transaction.on_commit(catalog_publish)
    return pool


@transaction.atomic
def pool_configure(
    *,
    pool: Pool,
    max_inflight: int | None = None,
    policy: str | None = None,
    max_queue_wait_seconds: int | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
) -> Pool:
    for field, value in (
        ("max_inflight", max_inflight),
        ("policy", policy),
        ("max_queue_wait_seconds", max_queue_wait_seconds),
        ("max_loras", max_loras),
        ("max_lora_rank", max_lora_rank),
    ):
        if value is not None:
            setattr(pool, field, value)
    pool.full_clean()
    pool.save()
    transaction.on_commit(catalog_publish)
    return pool


@transaction.atomic
def replica_set_state(*, replica: Replica, state: str) -> Replica:
    """An operator's decision (drain for an upgrade, bring back): probes keep draining as is."""
    replica.state = state
    replica.full_clean()
    replica.save(update_fields=["state"])
    transaction.on_commit(catalog_publish)
    return replica


def replica_probe(*, replica: Replica, timeout: float | None = None) -> Replica:
    """Ask the engine whether it is healthy and serves the pool's model; record the answer.

    A draining replica stays draining (an operator put it there); others become ready or down.
    """
    timeout = timeout or settings.INFERPLANE_PROBE_TIMEOUT_SECONDS
    served = replica.pool.model.served_name
    error = ""
    loaded: set[str] | None = None
    started_ms = _redis_now_ms()
    try:
        with httpx.Client(base_url=replica.url, timeout=timeout) as client:
            client.get("/health").raise_for_status()
            models = client.get("/v1/models").raise_for_status().json()
        cards = [m for m in models.get("data", []) if isinstance(m, dict)]
        names = {m.get("id") for m in cards}
        if served not in names:
            error = f"engine does not serve {served!r} (it serves {sorted(map(str, names))})"
        else:
            # LoRA adapters are the cards with a parent (the base model they apply to).
            loaded = {str(m["id"]) for m in cards if m.get("parent") and m.get("id")}
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    previous = replica.state
    if replica.state != Replica.State.DRAINING:
        replica.state = Replica.State.DOWN if error else Replica.State.READY
    replica.last_error = error
    replica.last_probe_at = timezone.now()
    replica.save(update_fields=["state", "last_error", "last_probe_at"])
    if replica.state != previous:
        log.info("replica %s: %s -> %s %s", replica, previous, replica.state, error)
    if loaded is not None and started_ms is not None:
        # Bookkeeping only: its failure says nothing about the replica's health.
        try:
            _adapters_reconcile(replica, loaded, started_ms, timeout)
        except Exception:
            log.warning("could not reconcile the adapters of %s", replica, exc_info=True)
    return replica


def _redis_now_ms() -> int | None:
    """Redis's clock: the one the gateways' adapter records are scored with."""
    try:
        seconds, micros = redis_sync().time()
    except RedisError:
        return None
    return int(seconds) * 1000 + int(micros) // 1000


# The engine's adapters, made what the router believes: adapters the engine lists are held
# (found after a restart of ours, scored oldest); ones it no longer lists are dropped, unless
# a gateway recorded them since the probe began (a load racing the probe).
_RECONCILE = """
local on = {}
for i = 2, #ARGV do
  on[ARGV[i]] = true
  redis.call('ZADD', KEYS[1], 'NX', 0, ARGV[i])
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])) do
  if not on[m] then redis.call('ZREM', KEYS[1], m) end
end
return 1
"""
_ENGINE_NAME = re.compile(r"^(?P<slug>[^/]+)/(?P<name>[^/:]+):(?P<version>\d+)$")


def _adapters_reconcile(
    replica: Replica, loaded: set[str], started_ms: int, timeout: float
) -> None:
    """After an engine restart its adapters are gone; after a delete they must go. Unload
    what is no longer served (a delete that found the engine away), record the rest."""
    from tenants.models import Adapter

    served: set[str] = set()
    for name in loaded:
        match = _ENGINE_NAME.match(name)
        if (
            match
            and Adapter.objects.filter(
                tenant__slug=match["slug"],
                name=match["name"],
                version=int(match["version"]),
                status=Adapter.Status.READY,
                deleted_at__isnull=True,
            ).exists()
        ):
            served.add(name)
        else:
            answer = httpx.post(
                f"{replica.url}/v1/unload_lora_adapter",
                json={"lora_name": name},
                timeout=timeout,
            )
            log.info("unloaded %s from %s (not served): %s", name, replica, answer.status_code)
    redis_sync().eval(
        _RECONCILE,
        1,
        adapters_held_key(replica.pool.name, str(replica.pk)),
        started_ms,
        *sorted(served),
    )


def adapter_retire(*, adapter_id: int, force: bool = False) -> bool:
    """A deleted adapter leaves the engines: unloaded from every replica that may hold it
    (requests already running with it finish: vLLM's unload only forgets the name). Its
    files go once no request uses it any more and no other adapter shares them. False
    while a request still runs with it (the task tries again later)."""
    from tenants.models import Adapter
    from tenants.services import adapter_files_remove

    adapter = Adapter.objects.select_related("tenant").filter(pk=adapter_id).first()
    if adapter is None:  # its tenant is gone (and its rows with it)
        return True
    engine_name = f"{adapter.tenant.slug}/{adapter.name}:{adapter.version}"
    client = redis_sync()
    pools: set[str] = set()
    for replica in Replica.objects.select_related("pool"):
        try:
            httpx.post(
                f"{replica.url}/v1/unload_lora_adapter",
                json={"lora_name": engine_name},
                timeout=settings.INFERPLANE_PROBE_TIMEOUT_SECONDS,
            )
        except httpx.HTTPError as exc:  # the engine is away: its next probe unloads it
            log.info("could not unload %s from %s now: %s", engine_name, replica, exc)
        client.zrem(adapters_held_key(replica.pool.name, str(replica.pk)), engine_name)
        pools.add(replica.pool.name)
    busy = any(_adapter_in_flight(client, p, adapter.tenant_id, engine_name) for p in pools)
    if busy and not force:
        return False
    adapter_files_remove(adapter=adapter)
    return True


def _adapter_in_flight(client: Any, pool: str, tenant_id: int, engine_name: str) -> bool:
    """Whether a request for the adapter is admitted, or waiting for admission, in the pool
    (waiting ones are in their tenant's queue, or the pool's one queue under fcfs)."""
    prefix = pool_prefix(pool)
    rids = client.zrange(prefix + "inflight", 0, -1)
    rids += client.lrange(f"{prefix}q:{tenant_id}", 0, -1)
    rids += client.lrange(prefix + "fcfs", 0, -1)
    pipe = client.pipeline(transaction=False)
    for rid in rids:
        pipe.hget(prefix + "req:" + (rid.decode() if isinstance(rid, bytes) else rid), "adapter")
    return engine_name.encode() in pipe.execute()
