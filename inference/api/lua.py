"""Lua scripts registered once per Redis client (EVALSHA, reloaded by redis-py on NOSCRIPT,
so a restarted Redis needs nothing from us)."""

from __future__ import annotations

from redis.commands.core import AsyncScript

from inference.api.redis import redis_async

_cache: dict[tuple[int, str], AsyncScript] = {}


def script(source: str) -> AsyncScript:
    client = redis_async()
    key = (id(client), source)
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = client.register_script(source)
    return found
