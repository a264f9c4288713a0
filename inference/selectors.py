"""Reads for models, pools and replicas."""

from __future__ import annotations

import logging

from django.db.models import QuerySet
from redis.exceptions import RedisError

from controlplane.redis import redis_sync
from fleet.models import ModelRoute, Pool, Replica
from inference.catalog import pool_prefix

log = logging.getLogger(__name__)


def model_route_list() -> QuerySet[ModelRoute]:
    return ModelRoute.objects.order_by("name")


def pool_get(*, name: str) -> Pool:
    return Pool.objects.select_related("model").get(name=name)


def pool_list() -> QuerySet[Pool]:
    return Pool.objects.select_related("model").prefetch_related("replicas").order_by("name")


def replica_list(*, pool: Pool | None = None) -> QuerySet[Replica]:
    replicas = Replica.objects.select_related("pool__model")
    return replicas.filter(pool=pool) if pool is not None else replicas


def replica_get(*, pool: Pool, replica_id: int) -> Replica:
    return replica_list(pool=pool).get(pk=replica_id)


def replica_find(*, ref: str, pool: str | None = None) -> Replica:
    """The replica a person named: by URL (``http://…``) or by name, in one pool or any.
    Raises ``Replica.DoesNotExist``, or ``MultipleObjectsReturned`` when several pools have
    it (then the pool must be given)."""
    replicas = replica_list()
    if pool is not None:
        replicas = replicas.filter(pool__name=pool)
    if "://" in ref:
        return replicas.get(url=ref.strip().rstrip("/"))
    return replicas.get(name=ref)


def replicas_in_flight(*, pool: Pool, replicas: list[Replica] | None = None) -> dict[int, int]:
    """Requests in flight per replica, from the admission state in Redis (``rload``).
    Empty when Redis cannot be read: callers treat a missing replica as unknown."""
    replicas = list(pool.replicas.all()) if replicas is None else replicas
    if not replicas:
        return {}
    try:
        loads = redis_sync().hmget(pool_prefix(pool.name) + "rload", [str(r.pk) for r in replicas])
    except RedisError:
        log.warning("could not read the requests in flight of pool %s", pool.name)
        return {}
    return {r.pk: max(0, int(load or 0)) for r, load in zip(replicas, loads, strict=True)}


def replica_in_flight(*, replica: Replica) -> int:
    """Requests in flight on one replica; raises ``RedisError`` when Redis cannot say (a
    removal must not guess)."""
    load = redis_sync().hget(pool_prefix(replica.pool.name) + "rload", str(replica.pk))
    return max(0, int(load or 0))
