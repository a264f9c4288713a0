"""The serving catalog: models, pools and replicas as the gateway needs them, in Redis.

Postgres is the truth; the gateway never reads it per request. ``catalog_publish`` writes
a JSON snapshot (``ip:catalog``) that every web process polls, and per pool the set of
*ready* replicas with their capacity, which the admission script routes over. It runs after
every change made through the services and after every round of health probes, so a missed
publish heals within one probe interval.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from django.utils import timezone

from controlplane.redis import redis_sync
from inference.models import Model, Pool, Replica

log = logging.getLogger(__name__)

CATALOG_KEY = "ip:catalog"


def pool_prefix(pool: str) -> str:
    """Every admission key of a pool shares one hash tag, so one Lua script may touch them."""
    return f"ip:{{p:{pool}}}:"


def adapters_held_key(pool: str, replica: str) -> str:
    """The LoRA adapters a replica holds: engine-side name -> last used (ms), a zset."""
    return f"{pool_prefix(pool)}lora:{replica}"


def catalog_build() -> dict[str, Any]:
    from billing.pricing import prices_for_catalog

    prices = prices_for_catalog(at=timezone.now())
    models: dict[str, Any] = {}
    for model in Model.objects.prefetch_related("allowed_tenants").order_by("name"):
        models[model.name] = {
            "served_name": model.served_name,
            "context_length": model.context_length,
            "supports_lora": model.supports_lora,
            "accepts_images": model.accepts_images,
            "accepts_audio": model.accepts_audio,
            "is_public": model.is_public,
            "allowed_tenants": sorted(t.pk for t in model.allowed_tenants.all()),
            "created": int(model.created_at.timestamp()),
            "online_pool": None,
            "batch_pool": None,
            "prices": prices.get(model.name, {}),
        }
    pools: dict[str, Any] = {}
    for pool in Pool.objects.select_related("model").prefetch_related("replicas").order_by("name"):
        pools[pool.name] = {
            "kind": pool.kind,
            "model": pool.model.name,
            "policy": pool.policy,
            "max_inflight": pool.max_inflight,
            "max_queue_wait_seconds": pool.max_queue_wait_seconds,
            "max_loras": pool.max_loras,
            "replicas": {
                str(r.pk): {"url": r.url, "state": r.state, "name": r.name}
                for r in pool.replicas.all()
            },
        }
        slot = "online_pool" if pool.kind == Pool.Kind.DEDICATED else "batch_pool"
        if models[pool.model.name][slot] is None:
            models[pool.model.name][slot] = pool.name
    return {
        "version": time.time_ns(),
        "models": models,
        "pools": pools,
        "adapters": _adapters(models),
    }


def _adapters(models: dict[str, Any]) -> dict[str, Any]:
    """Ready adapters by ``<tenant-slug>/<name>``: whose they are, their base model, and per
    version the engine-side name and the directory an engine loads them from."""
    from tenants.models import Adapter
    from tenants.services import adapter_local_dir

    adapters: dict[str, Any] = {}
    ready = (
        Adapter.objects.filter(status=Adapter.Status.READY, deleted_at__isnull=True)
        .select_related("tenant", "base_model")
        .order_by("tenant__slug", "name", "version")
    )
    for adapter in ready:
        if adapter.base_model is None or adapter.base_model.name not in models:
            continue
        address = f"{adapter.tenant.slug}/{adapter.name}"
        entry = adapters.setdefault(
            address,
            {
                "tenant": adapter.tenant_id,
                "created": int(adapter.created_at.timestamp()),
                "latest": 0,
                "versions": {},
            },
        )
        try:
            path = adapter_local_dir(adapter=adapter)
        except OSError:  # storage unreachable: not servable until the next publish
            log.warning("adapter %s has no local copy for the engines", adapter, exc_info=True)
            path = ""
        entry["versions"][str(adapter.version)] = {
            "engine_name": f"{address}:{adapter.version}",
            "path": path,
            "model": adapter.base_model.name,
        }
        entry["latest"] = adapter.version  # ordered by version: the newest wins
    return adapters


def catalog_publish() -> dict[str, Any]:
    catalog = catalog_build()
    client = redis_sync()
    pipe = client.pipeline(transaction=True)
    pipe.set(CATALOG_KEY, orjson.dumps(catalog))
    for name, pool in catalog["pools"].items():
        prefix = pool_prefix(name)
        ready = {
            rid: pool["max_inflight"]
            for rid, replica in pool["replicas"].items()
            if replica["state"] == Replica.State.READY
        }
        pipe.delete(prefix + "replicas")
        if ready:
            pipe.hset(prefix + "replicas", mapping=ready)
        else:
            # An empty hash cannot exist; this marker says "catalog known, no capacity".
            pipe.hset(prefix + "replicas", "none", 0)
        pipe.set(prefix + "policy", pool["policy"])
    pipe.execute()
    return catalog
