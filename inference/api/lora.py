"""Tenants' LoRA adapters on the engines, loaded on demand.

Per pool and replica, under the pool's hash tag (``ip:{p:<pool>}:``), so the admission
script can prefer replicas that already hold a request's adapter:
  lora:<replica>        zset   engine-side adapter name -> last used (ms): what it holds
  lora_inuse:<replica>  hash   engine-side adapter name -> requests using it right now
  lora_lock:<replica>   string the one process loading onto that replica (single flight)
  lora_stats            hash   "<replica>|loads" / "<replica>|evictions" counters

A request whose replica lacks its adapter loads it (``POST /v1/load_lora_adapter``) under
the replica's lock; requests arriving meanwhile wait for that load instead of starting
their own. A replica holding ``max_loras`` adapters first unloads its least recently used
one that no request is using. vLLM's unload only forgets the name: requests already running
with it finish normally. The health probe reconciles these sets with what each engine lists
in ``/v1/models`` (an engine that restarted holds nothing), see ``inference.services``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import aiohttp
from redis.asyncio.client import Pipeline

from inference.api.lua import script
from inference.api.redis import redis_async
from inference.api.upstream import TRANSPORT_ERRORS, engine_session
from inference.catalog import adapters_held_key, pool_prefix

log = logging.getLogger(__name__)

LOCK_MS = 60_000  # longest a load may hold a replica's lock (a crashed loader's lock expires)
WAIT_SECONDS = 60.0  # longest a request waits for another request's load of its adapter
POLL_SECONDS = 0.02

_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LoadFailed(Exception):
    """The replica could not load the adapter (unreachable, or it refused): try another."""


def _inuse_key(pool: str, replica: str) -> str:
    return f"{pool_prefix(pool)}lora_inuse:{replica}"


def _lock_key(pool: str, replica: str) -> str:
    return f"{pool_prefix(pool)}lora_lock:{replica}"


def stats_key(pool: str) -> str:
    return f"{pool_prefix(pool)}lora_stats"


def _now_ms() -> int:
    return int(time.time() * 1000)


async def use(pool: str, replica: str, name: str) -> bool:
    """Count a request using the adapter on the replica (it is not evicted meanwhile) and
    mark it recently used; whether the replica already holds it."""
    pipe = redis_async().pipeline(transaction=False)
    pipe.hincrby(_inuse_key(pool, replica), name, 1)
    pipe.zadd(adapters_held_key(pool, replica), {name: _now_ms()}, xx=True)
    pipe.zscore(adapters_held_key(pool, replica), name)
    results = await pipe.execute()
    return results[2] is not None


async def unuse(pool: str, replica: str, name: str) -> None:
    await redis_async().hincrby(_inuse_key(pool, replica), name, -1)


def unuse_into(pipe: Pipeline, pool: str, replica: str, name: str) -> None:
    pipe.hincrby(_inuse_key(pool, replica), name, -1)


async def forget(pool: str, replica: str, name: str) -> None:
    """The engine says it does not hold the adapter (it restarted): load it again next time."""
    await redis_async().zrem(adapters_held_key(pool, replica), name)


async def load(*, pool: str, replica: str, url: str, name: str, path: str, capacity: int) -> None:
    """Make sure the replica holds the adapter: load it once, however many ask at once."""
    client = redis_async()
    key, lock = adapters_held_key(pool, replica), _lock_key(pool, replica)
    token = uuid.uuid4().hex
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        if await client.set(lock, token, nx=True, px=LOCK_MS):
            try:
                if await client.zscore(key, name) is None:
                    await _make_room(pool, replica, url, keep=name, capacity=capacity)
                    body = {"lora_name": name, "lora_path": path}
                    await _post(url, "/v1/load_lora_adapter", body)
                    pipe = client.pipeline(transaction=False)
                    pipe.zadd(key, {name: _now_ms()})
                    pipe.hincrby(stats_key(pool), f"{replica}|loads", 1)
                    await pipe.execute()
                    log.info("loaded adapter %s on %s", name, url)
                return
            finally:
                await script(_UNLOCK)(keys=[lock], args=[token])
        await asyncio.sleep(POLL_SECONDS)
        if await client.zscore(key, name) is not None:
            return
        if time.monotonic() > deadline:
            raise LoadFailed(f"timed out waiting for {name} to load on {url}")


async def _make_room(pool: str, replica: str, url: str, *, keep: str, capacity: int) -> None:
    """Unload least recently used adapters no request is using until one more fits. When
    every one is in use, load over capacity: vLLM takes it (swapping in its own cache), and
    the next load evicts back down."""
    client = redis_async()
    key = adapters_held_key(pool, replica)
    members = await client.zrange(key, 0, -1)  # least recently used first
    held = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
    excess = len(held) - capacity + 1
    if excess <= 0:
        return
    using = await client.hmget(_inuse_key(pool, replica), held)
    for victim, count in zip(held, using, strict=True):
        if excess <= 0:
            break
        if victim == keep or int(count or 0) > 0:
            continue
        await unload(url, victim)
        pipe = client.pipeline(transaction=False)
        pipe.zrem(key, victim)
        pipe.hdel(_inuse_key(pool, replica), victim)
        pipe.hincrby(stats_key(pool), f"{replica}|evictions", 1)
        await pipe.execute()
        log.info("evicted adapter %s from %s", victim, url)
        excess -= 1


async def unload(url: str, name: str) -> None:
    """Unload from one engine; one that no longer holds it is fine."""
    await _post(url, "/v1/unload_lora_adapter", {"lora_name": name}, missing_ok=True)


async def _post(url: str, path: str, body: dict[str, str], *, missing_ok: bool = False) -> None:
    try:
        async with engine_session().post(
            url + path, json=body, timeout=aiohttp.ClientTimeout(total=WAIT_SECONDS)
        ) as response:
            text = (await response.read()).decode(errors="replace")
    except TRANSPORT_ERRORS as exc:
        raise LoadFailed(f"{path} on {url}: {type(exc).__name__}: {exc}") from exc
    if response.status == 200:
        return
    if missing_ok and response.status == 404:
        return
    if response.status == 400 and "already been loaded" in text:
        return  # loaded by someone who could not record it (e.g. Redis was flushed)
    raise LoadFailed(f"{path} on {url}: HTTP {response.status}: {text[:300]}")
