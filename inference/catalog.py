"""The serving catalog: models, pools and replicas as the gateway needs them, in Redis.

Postgres is the truth; the gateway never reads it per request. ``catalog_publish`` writes
a JSON snapshot (``ip:catalog``) that every web process polls, and per pool the set of
*ready* replicas with their capacity, which the admission script routes over. It runs after
every change made through the services and after every round of health probes, so a missed
publish heals within one probe interval.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, cast

import msgspec
from django.utils import timezone
from redis.exceptions import RedisError

from adapters.publishing import adapters_for_catalog
from billing.pricing import prices_for_catalog
from contract import Catalog, CatalogModel, CatalogPool, CatalogReplica, catalog_decoder, encode
from controlplane.redis import redis_sync
from inference.models import Model, ModelRoute, Pool, Replica

log = logging.getLogger(__name__)

CATALOG_KEY = "ip:catalog"
# Bumped by a publish that changed something: web processes poll this small key and fetch
# the snapshot only when it moved (inference.api.catalog). The digest says what was last
# published, so a health probe round that changed nothing costs the gateways nothing.
CATALOG_VERSION_KEY = "ip:catalog:version"
CATALOG_DIGEST_KEY = "ip:catalog:digest"


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


def catalog_publish() -> Catalog:
    catalog = catalog_build()
    digest = hashlib.sha256(encode(msgspec.structs.replace(catalog, version=0))).hexdigest()
    client = redis_sync()
    pipe = client.pipeline(transaction=True)
    pipe.set(CATALOG_DIGEST_KEY, digest, get=True)
    pipe.exists(CATALOG_VERSION_KEY)
    pipe.set(CATALOG_KEY, encode(catalog))
    for name, pool in catalog.pools.items():
        prefix = pool_prefix(name)
        ready: dict[Any, int] = {
            rid: pool.max_inflight
            for rid, replica in pool.replicas.items()
            if replica.state == Replica.State.READY
        }
        pipe.delete(prefix + "replicas")
        if ready:
            pipe.hset(prefix + "replicas", mapping=ready)
        else:
            # An empty hash cannot exist; this marker says "catalog known, no capacity".
            pipe.hset(prefix + "replicas", "none", 0)
        pipe.set(prefix + "policy", pool.policy)
    previous, versioned = pipe.execute()[:2]
    if not versioned or previous is None or previous.decode() != digest:
        client.incr(CATALOG_VERSION_KEY)
    return catalog


def catalog_read() -> Catalog:
    """The catalog as the gateways serve it now, for synchronous readers (the dashboard):
    the published snapshot, or a fresh build when Redis has none or cannot be read."""
    try:
        raw = redis_sync().get(CATALOG_KEY)
    except RedisError:
        log.warning("serving catalog unreadable in Redis: building it", exc_info=True)
        return catalog_build()
    if raw is not None:
        try:
            return catalog_decoder.decode(cast(bytes, raw))
        except msgspec.DecodeError:
            log.warning("serving catalog in Redis unreadable: republishing it", exc_info=True)
    return catalog_publish()
