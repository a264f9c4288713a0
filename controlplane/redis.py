"""The Redis clients every process shares (one pool per process, per event loop for async).

They hold the data plane's state (``STATE_REDIS_URL``): one Redis, or a Redis Cluster when the
URL's scheme is ``redis+cluster://`` (``rediss+cluster://`` with TLS). On a cluster every
script, transaction and multi-key command touches one slot: each key carries the hash tag of
what it belongs to (``{p:<pool>}``, ``{t:<tenant>}``, ``{catalog}``, ``{moderation}``), and
pub/sub is sharded (``SPUBLISH``/``SSUBSCRIBE``, Redis 7). A pipeline without a transaction
may span slots (the cluster client sends each node its part). Celery's broker and Channels
use ``REDIS_URL``, a plain Redis: neither runs on a cluster.
"""

from __future__ import annotations

import time
from functools import cache
from typing import Any, cast

import redis
from django.conf import settings
from redis.cluster import RedisCluster

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def cluster_seed(url: str) -> str | None:
    """The URL of a cluster's seed node when ``url`` names a cluster, else None."""
    scheme, sep, rest = url.partition("://")
    plain = _CLUSTER_SCHEMES.get(scheme)
    return f"{plain}{sep}{rest}" if plain else None


def state_is_cluster() -> bool:
    return cluster_seed(settings.STATE_REDIS_URL) is not None


def state_client(**options: Any) -> redis.Redis:
    """A new client of the state's Redis. A cluster's client is typed as a plain one: both
    answer the commands used here the same way."""
    seed = cluster_seed(settings.STATE_REDIS_URL)
    if seed is None:
        return redis.Redis.from_url(settings.STATE_REDIS_URL, **options)
    return RedisCluster.from_url(seed, **options)  # type: ignore[return-value]


def disconnect(client: redis.Redis) -> None:
    """Close every connection of ``client`` (blocked reads on them end at once)."""
    if isinstance(client, RedisCluster):
        client.disconnect_connection_pools()
    else:
        client.connection_pool.disconnect()


@cache
def redis_sync() -> redis.Redis:
    # No health-check PING before a command on a connection idle for a while (one per
    # process per periodic task, most of an idle platform's PINGs): a dead connection fails
    # within the socket timeout, and redis-py retries on a fresh one.
    return state_client(socket_timeout=2, socket_connect_timeout=2)


@cache
def channel(name: str) -> str:
    """The pub/sub channel ``name`` of this deployment's Redis database. Redis's channels
    belong to the whole server, not to a database: two deployments (or two test groups) on
    one server, each in a database of its own, would otherwise hear each other's changes.
    The database's number goes into the name, as Celery's broker does for its fanout. (A
    cluster has one database.)"""
    client = redis_sync()
    db = (
        0
        if isinstance(client, RedisCluster)
        else client.connection_pool.connection_kwargs.get("db", 0)
    )
    return f"{name}:db{db}"


# How many processes an announcement of version N reached, and how many have applied it
# since (each watcher counts itself once it has looked: ``inference.gateway.watch``), kept an
# hour: ``applied_wait`` waits for the second to reach the first (a drill, a test: "every
# gateway serves this now"). Keys ``ip:{<tag>}:reached:<N>`` and ``ip:{<tag>}:applied:<N>``.
APPLIED_SECONDS = 3600


def announced_keys(tag: str, version: str | int) -> tuple[str, str]:
    """(reached, applied) of an announcement of ``version`` of what ``tag`` names."""
    return f"ip:{{{tag}}}:reached:{version}", f"ip:{{{tag}}}:applied:{version}"


def announce(name: str, message: str | int, *, tag: str | None = None) -> int:
    """Publish ``message`` on the channel ``name`` (sharded pub/sub: on a cluster, only the
    channel's shard carries it; ``inference.gateway.watch`` subscribes); returns how many
    subscribers it reached (on a cluster, those connected to the node it was sent to). With
    ``tag``, ``message`` is a version and its reach is kept for ``applied_wait``."""
    client = redis_sync()
    reached = int(client.spublish(channel(name), message))
    if tag is not None:
        client.set(announced_keys(tag, message)[0], reached, ex=APPLIED_SECONDS)
    return reached


def applied_wait(tag: str, version_key: str, *, within: float, what: str) -> int:
    """Wait until every process the announcement of ``version_key``'s version reached (the
    watchers holding a copy) has applied it or a newer one; returns how many. One not
    holding a copy was not reached: it reads the snapshot when it first needs it. A version
    whose announcement is not counted yet (the publisher between its write and its
    ``SPUBLISH``) is waited for too. Raises ``TimeoutError`` naming the version when that
    does not happen within ``within`` seconds (nor for one announced over an hour ago)."""
    client = redis_sync()
    raw = cast(bytes | None, client.get(version_key))
    if raw is None:  # nothing published (a Redis that lost it rebuilds it on first use)
        return 0
    version = raw.decode()
    reached_key, applied_key = announced_keys(tag, version)
    deadline = time.monotonic() + within
    while True:
        reached, applied = cast(list[bytes | None], client.mget(reached_key, applied_key))
        if reached is not None and int(applied or 0) >= int(reached):
            return int(applied or 0)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{int(applied or 0)} of {'?' if reached is None else int(reached)} processes "
                f"applied {what}'s version {version} within {within} s"
            )
        time.sleep(0.01)  # a poll of Redis's counters, bounded by the deadline above


@cache
def redis_blocking() -> redis.Redis:
    """For reads that block until work arrives (the drains' ``XREADGROUP``/``BLPOP``): a pool of
    its own, whose socket waits longer than a block does (``redis_sync``'s gives up at 2 s)."""
    return state_client(
        socket_timeout=settings.INFERPLANE_DRAIN_BLOCK_SECONDS + 5,
        socket_connect_timeout=2,
        health_check_interval=30,
    )
