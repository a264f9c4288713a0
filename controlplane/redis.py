"""The Redis clients every process shares (one pool per process, per event loop for async)."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings


@cache
def redis_sync() -> redis.Redis:
    # No health-check PING before a command on a connection idle for a while (one per
    # process per periodic task, most of an idle platform's PINGs): a dead connection fails
    # within the socket timeout, and redis-py retries on a fresh one.
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


@cache
def channel(name: str) -> str:
    """The pub/sub channel ``name`` of this deployment's Redis database. Redis's channels
    belong to the whole server, not to a database: two deployments (or two test groups) on
    one server, each in a database of its own, would otherwise hear each other's changes.
    The database's number goes into the name, as Celery's broker does for its fanout."""
    db = redis_sync().connection_pool.connection_kwargs.get("db", 0)
    return f"{name}:db{db}"


@cache
def redis_blocking() -> redis.Redis:
    """For reads that block until work arrives (the drains' ``XREADGROUP``/``BLPOP``): a pool of
    its own, whose socket waits longer than a block does (``redis_sync``'s gives up at 2 s)."""
    return redis.Redis.from_url(
        settings.REDIS_URL,
        socket_timeout=settings.INFERPLANE_DRAIN_BLOCK_SECONDS + 5,
        socket_connect_timeout=2,
        health_check_interval=30,
    )
