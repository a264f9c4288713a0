"""Lua scripts registered once per Redis client (EVALSHA, reloaded by redis-py on NOSCRIPT,
so a restarted Redis needs nothing from us)."""

from __future__ import annotations

from typing import Any

from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript

from inference.api.redis import redis_async

_cache: dict[tuple[int, str], AsyncScript] = {}


def run_into(pipe: Pipeline, source: str, keys: list[str], args: list[Any]) -> None:
    """Queue a script on a pipeline by its SHA only. (Registering it with the pipeline would
    cost a SCRIPT EXISTS round trip per execute.) A Redis that lost it answers NOSCRIPT, and
    the caller runs the work again through ``script()``, which reloads it."""
    pipe.evalsha(script(source).sha, len(keys), *keys, *args)


def script(source: str) -> AsyncScript:
    client = redis_async()
    key = (id(client), source)
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = client.register_script(source)
    return found
