"""The Redis clients every process shares (one pool per process, per event loop for async)."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings


@cache
def redis_sync() -> redis.Redis:
    return redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2, health_check_interval=30
    )


@cache
def channel(name: str) -> str:
    """The pub/sub channel ``name`` of this deployment's Redis database. Redis's channels
    belong to the whole server, not to a database: two deployments (or two test groups) on
    one server, each in a database of its own, would otherwise hear each other's changes.
    The database's number goes into the name, as Celery's broker does for its fanout."""
    db = redis_sync().connection_pool.connection_kwargs.get("db", 0)
    return f"{name}:db{db}"
