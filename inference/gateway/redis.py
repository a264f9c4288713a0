"""The async Redis client of this process (one per event loop), shared by the hot path."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# How long an admission listener with nobody waiting blocks on its grants list before it
# looks again (``inference.gateway.admission``): its idle cost, one BLPOP per this long.
LISTEN_IDLE_SECONDS = 30

_shared: dict[asyncio.AbstractEventLoop, aioredis.Redis] = {}
_blocking: dict[asyncio.AbstractEventLoop, aioredis.Redis] = {}


def redis_async() -> aioredis.Redis:
    """The hot path's client: a read that takes more than 5 s means a dead connection."""
    return _for_this_loop(_shared, socket_timeout=5, health_check_interval=30, max_connections=512)


def redis_async_blocking() -> aioredis.Redis:
    """For the admission listeners' long blocking reads: a pool of its own whose socket
    outwaits the longest block. No health-check PING before each read: a dead connection
    shows as the read's own timeout."""
    return _for_this_loop(_blocking, socket_timeout=LISTEN_IDLE_SECONDS + 5)


def _for_this_loop(
    clients: dict[asyncio.AbstractEventLoop, aioredis.Redis], **options: Any
) -> aioredis.Redis:
    loop = asyncio.get_running_loop()
    client = clients.get(loop)
    if client is None:
        client = clients[loop] = aioredis.Redis.from_url(
            settings.REDIS_URL,
            socket_connect_timeout=2,
            # Which process a connection is (CLIENT LIST): the operator's, and the benchmark's
            # count of what an idle gateway asks Redis.
            client_name=f"inferplane-gateway-{os.getpid()}",
            # A restarted Redis is reconnected to on the next command, not by a restart of ours.
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=3),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            **options,
        )
    return client
