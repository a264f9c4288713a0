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
