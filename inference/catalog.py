"""The serving catalog: models, pools and replicas as the gateway needs them, in Redis.

Postgres is the truth; the gateway never reads it per request. ``catalog_publish`` writes
a JSON snapshot (``ip:catalog``) that every web process reads when told it changed
(``ip:catalog:changed:db<N>``), and per pool the set of *ready* replicas with their capacity,
which the admission script routes over. It runs after every change made through the
services and after every round of health probes, so a missed publish heals within one probe
interval (a lost announcement, within the gateways' minute between looks).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from pathlib import Path
from typing import Any, cast

import msgspec
from django.utils import timezone
from redis.exceptions import LockError, NoScriptError, RedisError

from adapters.publishing import adapters_for_catalog
from billing.pricing import prices_for_catalog
from contract import (
    Catalog,
    CatalogAdapter,
    CatalogModel,
    CatalogPool,
    CatalogReplica,
    catalog_decoder,
    encode,
)
from controlplane.redis import announce, applied_wait, redis_sync
from fleet.models import Model, ModelRoute, Pool, Replica

log = logging.getLogger(__name__)

CATALOG_KEY = "ip:{catalog}"
# Bumped by a publish that changed something: web processes poll this small key and fetch
# the snapshot only when it moved (inference.gateway.catalog). The digest says what was last
# published, so a health probe round that changed nothing costs the gateways nothing.
CATALOG_VERSION_KEY = "ip:{catalog}:version"
CATALOG_DIGEST_KEY = "ip:{catalog}:digest"
# Where a publish that changed something is announced (the new version): web processes
# subscribe (inference.gateway.watch) instead of polling the version.
CATALOG_CHANNEL = "ip:catalog:changed"
# Its announcements' reach and the processes that applied them (``applied_wait``).
CATALOG_TAG = "catalog"
PUBLISH_LOCK = "ip:{catalog}:publish-lock"

# The adapters are not in the snapshot but in parts, one per tenant (a hash: tenant id ->
# its adapters), which a web process fetches when that tenant first calls and again only
# when that part changed: 50,000 adapter versions would make a snapshot of 11 MB that every
# process re-read on every upload (bench/scale.py). Each publish that changes parts bumps
# the serial and announces ``a:<serial>:<tenant>,<tenant>…`` (``a:<serial>:*``: all).
ADAPTERS_KEY = "ip:{catalog}:adapters"
ADAPTERS_DIGEST_KEY = "ip:{catalog}:adapters:digest"
ADAPTERS_SERIAL_KEY = "ip:{catalog}:adapters:serial"
ANNOUNCE_TENANTS = 200  # more changed parts than this are announced as "all"
adapters_part_decoder = msgspec.json.Decoder(dict[str, CatalogAdapter])


def pool_prefix(pool: str) -> str:
    """Every admission key of a pool shares one hash tag, so one Lua script may touch them."""
    return f"ip:{{p:{pool}}}:"


def adapters_held_key(pool: str, replica: str) -> str:
    """The LoRA adapters a replica holds: engine-side name -> last used (ms), a zset."""
    return f"{pool_prefix(pool)}lora:{replica}"


def catalog_build() -> Catalog:
    prices = prices_for_catalog(at=timezone.now())
    pools: dict[str, CatalogPool] = {}
    serving: dict[tuple[str, str], str] = {}  # (model, "online" | "batch") -> its first pool
    for pool in Pool.objects.select_related("model").prefetch_related("replicas").order_by("name"):
        pools[pool.name] = CatalogPool(
            kind=pool.kind,
            model=pool.model.name,
            policy=pool.policy,
            max_inflight=pool.max_inflight,
            max_queue_wait_seconds=pool.max_queue_wait_seconds,
            max_loras=pool.max_loras,
            lend_percent=pool.lend_percent if pool.kind == Pool.Kind.DEDICATED else 0,
            replicas={
                str(r.pk): CatalogReplica(url=r.url, state=r.state, name=r.name)
                for r in pool.replicas.all()
            },
        )
        kind = "online" if pool.kind == Pool.Kind.DEDICATED else "batch"
        serving.setdefault((pool.model.name, kind), pool.name)
    models: dict[str, CatalogModel] = {}
    for model in Model.objects.prefetch_related("allowed_tenants").order_by("name"):
        models[model.name] = CatalogModel(
            served_name=model.served_name,
            context_length=model.context_length,
            supports_lora=model.supports_lora,
            accepts_images=model.accepts_images,
            accepts_audio=model.accepts_audio,
            is_public=model.is_public,
            allowed_tenants=frozenset(t.pk for t in model.allowed_tenants.all()),
            created=int(model.created_at.timestamp()),
            online_pool=serving.get((model.name, "online")),
            batch_pool=serving.get((model.name, "batch")),
            prices=prices.get(model.name, {}),
            task=model.task,
        )
    return Catalog(
        version=time.time_ns(),
        models=models,
        pools=pools,
        adapters=adapters_for_catalog(set(models)),
        routes={
            route.name: [(str(target), int(weight)) for target, weight in route.targets]
            for route in ModelRoute.objects.all()
        },
    )


def _adapter_parts(catalog: Catalog) -> dict[str, bytes]:
    parts: dict[int, dict[str, CatalogAdapter]] = {}
    for address, entry in catalog.adapters.items():
        parts.setdefault(entry.tenant, {})[address] = entry
    return {str(tenant): encode(part) for tenant, part in parts.items()}


def _publish_adapters(client: Any, catalog: Catalog) -> None:
    """Write the tenants' parts that changed (by digest), drop those of tenants that have
    none left, and announce which."""
    parts = _adapter_parts(catalog)
    digests = {t: hashlib.sha256(raw).hexdigest() for t, raw in parts.items()}
    known = {
        k.decode(): v.decode()
        for k, v in cast(dict[bytes, bytes], client.hgetall(ADAPTERS_DIGEST_KEY)).items()
    }
    changed = [t for t, d in digests.items() if known.get(t) != d]
    gone = [t for t in known if t not in digests]
    if not changed and not gone:
        return
    pipe = client.pipeline(transaction=True)
    if changed:
        pipe.hset(ADAPTERS_KEY, mapping={t: parts[t] for t in changed})
        pipe.hset(ADAPTERS_DIGEST_KEY, mapping={t: digests[t] for t in changed})
    if gone:
        pipe.hdel(ADAPTERS_KEY, *gone)
        pipe.hdel(ADAPTERS_DIGEST_KEY, *gone)
    pipe.incr(ADAPTERS_SERIAL_KEY)
    serial = pipe.execute()[-1]
    tenants = [*changed, *gone]
    which = ",".join(tenants) if len(tenants) <= ANNOUNCE_TENANTS else "*"
    try:
        announce(CATALOG_CHANNEL, f"a:{serial}:{which}")
    except RedisError:
        log.warning("could not announce the adapters that changed", exc_info=True)


def adapters_part_read(client: Any, tenant_id: int) -> dict[str, CatalogAdapter]:
    """One tenant's adapters as published (empty when it has none)."""
    raw = client.hget(ADAPTERS_KEY, str(tenant_id))
    return {} if raw is None else adapters_part_decoder.decode(raw)


_POOL_PART = (Path(__file__).with_name("lua") / "catalog_pool.lua").read_text()
_POOL_PART_SHA = hashlib.sha1(_POOL_PART.encode(), usedforsecurity=False).hexdigest()


def _publish_round(client: Any, catalog: Catalog) -> list[Any]:
    """One round trip: what the snapshot was, and each pool's part written where it differs
    (the script by SHA, as a raw command: redis-py's cluster pipeline refuses ``evalsha``)."""
    pipe = client.pipeline(transaction=False)
    pipe.get(CATALOG_DIGEST_KEY)
    pipe.exists(CATALOG_VERSION_KEY, CATALOG_KEY)
    for name, pool in catalog.pools.items():
        ready = [
            str(x)
            for rid, replica in pool.replicas.items()
            if replica.state == Replica.State.READY
            for x in (rid, pool.max_inflight)
        ]
        keys = [pool_prefix(name)]
        args = [pool.policy, pool.lend_percent, *ready]
        pipe.execute_command("EVALSHA", _POOL_PART_SHA, len(keys), *keys, *args)
    results: list[Any] = pipe.execute(raise_on_error=False)
    return results


def catalog_publish(*, force: bool = False) -> Catalog:
    """Publish the catalog (the snapshot without the adapters, and the adapters' parts that
    changed); returns it whole, as built. The snapshot is written when it changed (or is
    missing), and always with ``force`` (for one a reader found unreadable)."""
    # One publisher at a time, each building inside the lock: a health-probe round that read
    # the database just before a change committed cannot write its older copy after the
    # change's own publish (which runs on commit, so it waits here and writes last). A lock
    # not had within its wait, or lost meanwhile (expired, flushed), does not stop a publish.
    lock = redis_sync().lock(PUBLISH_LOCK, timeout=30, blocking_timeout=30)
    if not lock.acquire():
        log.warning("publishing the catalog without its lock (held over 30 s)")
    try:
        return _publish(force=force)
    finally:
        with contextlib.suppress(LockError):
            lock.release()


def _publish(*, force: bool) -> Catalog:
    catalog = catalog_build()
    snapshot = msgspec.structs.replace(catalog, adapters={})
    digest = hashlib.sha256(encode(msgspec.structs.replace(snapshot, version=0))).hexdigest()
    client = redis_sync()
    _publish_adapters(client, catalog)
    results = _publish_round(client, catalog)
    if any(isinstance(r, NoScriptError) for r in results):
        client.script_load(_POOL_PART)  # a Redis (or a node) that restarted: the parts again
        results = _publish_round(client, catalog)
    for result in results:
        if isinstance(result, Exception):
            raise result
    previous, present = results[:2]
    if force or previous is None or previous.decode() != digest or present < 2:
        pipe = client.pipeline(transaction=True)
        pipe.set(CATALOG_KEY, encode(snapshot))
        pipe.set(CATALOG_DIGEST_KEY, digest)
        pipe.incr(CATALOG_VERSION_KEY)
        version = pipe.execute()[-1]
        # A lost announcement only waits for the gateways' next look at the version.
        try:
            announce(CATALOG_CHANNEL, version, tag=CATALOG_TAG)
        except RedisError:
            log.warning("could not announce the catalog's new version", exc_info=True)
    return catalog


def catalog_applied(*, within: float) -> int:
    """Wait until every process holding a copy of the catalog has applied the version last
    announced (``controlplane.redis.applied_wait``)."""
    return applied_wait(CATALOG_TAG, CATALOG_VERSION_KEY, within=within, what="the serving catalog")


def catalog_published() -> Catalog | None:
    """The published snapshot (pools, replicas and their states, models; no adapters), or
    None when Redis has none; raises ``RedisError`` and ``msgspec.DecodeError``. Costs the
    database nothing (``/metrics`` reads the replicas' states here)."""
    raw = redis_sync().get(CATALOG_KEY)
    return None if raw is None else catalog_decoder.decode(cast(bytes, raw))


def catalog_read(*, tenant_id: int) -> Catalog:
    """The catalog as the gateways serve it to a tenant now (its own adapters in it), for
    synchronous readers (the dashboard, batches): the published snapshot, or a fresh build
    when Redis has none or cannot be read."""
    try:
        snapshot = catalog_published()
        if snapshot is not None:
            adapters = adapters_part_read(redis_sync(), tenant_id)
            return msgspec.structs.replace(snapshot, adapters=adapters)
    except RedisError:
        log.warning("serving catalog unreadable in Redis: building it", exc_info=True)
        return catalog_build()
    except msgspec.DecodeError:
        log.warning("serving catalog in Redis unreadable: republishing it", exc_info=True)
    return catalog_publish(force=True)
