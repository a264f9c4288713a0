"""The health probe: each replica's ``/health`` and metrics, whether its engine makes progress,
which LoRA adapters it holds (reconciled with Redis), and retiring an adapter's files."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, cast

import httpx
from django.conf import settings
from django.utils import timezone
from redis.exceptions import RedisError

from adapters.models import Adapter
from adapters.services import adapter_files_remove
from controlplane.redis import redis_sync
from fleet.engine_metrics import engine_metrics_parse
from fleet.models import (
    Replica,
)
from inference.catalog import adapters_held_key
from inference.engine_auth import engine_auth_headers
from inference.gateway.admission import adapter_in_use
from inference.gateway.lora import RECONCILE
from inference.gateway.lua import Script

log = logging.getLogger(__name__)


def replica_probe(
    *,
    replica: Replica,
    timeout: float | None = None,
    round_: ProbeRound | None = None,
) -> Replica:
    """Ask the engine whether it is healthy and serves the pool's model; record the answer.

    A draining replica stays draining (an operator put it there); others become ready or down.
    ``round_``: the probe round it is part of (what the round read of Redis once for all).
    """
    timeout = timeout or settings.INFERPLANE_PROBE_TIMEOUT_SECONDS
    alone = round_ is None  # a round of its own, ended here
    round_ = round_ or ProbeRound.begin()
    served = replica.pool.model.served_name
    error = ""
    loaded: set[str] | None = None
    started_ms = round_.started_ms
    try:
        with httpx.Client(
            base_url=replica.url, timeout=timeout, headers=engine_auth_headers()
        ) as client:
            client.get("/health").raise_for_status()
            models = client.get("/v1/models").raise_for_status().json()
            metrics = engine_metrics_parse(client.get("/metrics").raise_for_status().text)
        cards = [m for m in models.get("data", []) if isinstance(m, dict)]
        names = {m.get("id") for m in cards}
        if served not in names:
            error = f"engine does not serve {served!r} (it serves {sorted(map(str, names))})"
        else:
            # LoRA adapters are the cards with a parent (the base model they apply to).
            loaded = {str(m["id"]) for m in cards if m.get("parent") and m.get("id")}
            error = _progress_check(replica, metrics, round_)
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    previous = replica.state
    replica.last_error = error
    replica.last_probe_at = timezone.now()
    recorded = {"last_error": error, "last_probe_at": replica.last_probe_at}
    state = Replica.State.DOWN if error else Replica.State.READY
    # Draining is decided in the database, not on this copy: an operator or discovery may
    # have drained it while the probe ran (or removed it: then nothing is written).
    rows = Replica.objects.filter(pk=replica.pk)
    if rows.exclude(state=Replica.State.DRAINING).update(state=state, **recorded):
        replica.state = state
    elif rows.update(**recorded):
        replica.state = Replica.State.DRAINING
    if replica.state != previous:
        log.info("replica %s: %s -> %s %s", replica, previous, replica.state, error)
    # A model without LoRA support never has adapters placed on its replicas: nothing to
    # reconcile unless its engine lists some anyway.
    lora = replica.pool.model.supports_lora or bool(loaded)
    if loaded is not None and started_ms is not None and lora:
        # Bookkeeping only: its failure says nothing about the replica's health.
        try:
            _adapters_reconcile(replica, loaded, started_ms, timeout)
        except Exception:
            log.warning("could not reconcile the adapters of %s", replica, exc_info=True)
    if alone:
        round_.end()
    return replica


PROBE_PROGRESS = "ip:probe:progress"  # replica id -> "generated tokens|since (epoch s)"
IDLE = "idle"  # ... or this, while it runs nothing
ROUND = Script("probe", "round")  # the clock and the progress hash, at a round's start


@dataclass
class ProbeRound:
    """What a round of probes reads of Redis once for all its replicas, and writes once at
    its end: Redis's clock when it began (adapter records newer than that are left alone),
    and each engine's last generated-token count (``_progress_check``). A round costs Redis
    a few commands, not a few per replica. ``None`` where Redis could not say."""

    started_ms: int | None
    progress: dict[str, str] | None
    progress_changed: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def begin(cls) -> ProbeRound:
        try:  # one call, on one Redis or on the progress hash's node of a cluster
            now_ms, raw = cast(Any, redis_sync().eval(ROUND.source, 1, PROBE_PROGRESS))
        except RedisError:
            return cls(started_ms=None, progress=None)
        pairs = cast(list[bytes], raw)
        progress = {k.decode(): v.decode() for k, v in zip(pairs[::2], pairs[1::2], strict=True)}
        return cls(started_ms=int(now_ms), progress=progress)

    def end(self) -> None:
        if self.progress_changed:
            with contextlib.suppress(RedisError):
                redis_sync().hset(PROBE_PROGRESS, mapping=cast(Any, self.progress_changed))
            self.progress_changed = {}


def _progress_check(replica: Replica, metrics: dict[str, float], round_: ProbeRound) -> str:
    """An engine whose HTTP server answers while its engine core is stuck (a hung GPU, a
    wedged kernel) still says 200 on /health: it is down if it has requests running and
    its generated-token counter has not moved for the stall timeout. '' when it is fine."""
    field = str(replica.pk)
    generated, running = metrics["generation"], metrics["running"]
    now = time.time()
    if round_.progress is None:
        return ""  # bookkeeping unavailable: /health decides alone
    text = round_.progress.get(field, "")
    if running == 0:  # nothing to stall; written once, not every round of an idle engine
        if text != IDLE:
            round_.progress_changed[field] = IDLE
        return ""
    last_generated, _, since = text.partition("|")
    try:
        if text == IDLE or not since or float(last_generated) != generated:
            round_.progress_changed[field] = f"{generated}|{now}"  # the stall clock starts
            return ""
    except ValueError:
        round_.progress_changed[field] = f"{generated}|{now}"
        return ""
    silent = now - float(since)
    if silent < settings.INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS:
        return ""
    return (
        f"engine has {running:.0f} requests running and generated nothing for {silent:.0f} s "
        "(its /health still answers: the engine core is stuck)"
    )


_ENGINE_NAME = re.compile(r"^(?P<slug>[^/]+)/(?P<name>[^/:]+):(?P<version>\d+)$")


def _adapters_reconcile(
    replica: Replica, loaded: set[str], started_ms: int, timeout: float
) -> None:
    """After an engine restart its adapters are gone; after a delete they must go. Unload
    what is no longer served (a delete that found the engine away), record the rest."""

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
                headers=engine_auth_headers(),
            )
            log.info("unloaded %s from %s (not served): %s", name, replica, answer.status_code)
    redis_sync().eval(
        RECONCILE.source,  # the engine's adapters, made what the router believes
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
                headers=engine_auth_headers(),
            )
        except httpx.HTTPError as exc:  # the engine is away: its next probe unloads it
            log.info("could not unload %s from %s now: %s", engine_name, replica, exc)
        client.zrem(adapters_held_key(replica.pool.name, str(replica.pk)), engine_name)
        pools.add(replica.pool.name)
    busy = any(
        adapter_in_use(p, tenant_id=adapter.tenant_id, engine_name=engine_name) for p in pools
    )
    if busy and not force:
        return False
    adapter_files_remove(adapter=adapter)
    return True
