"""Tenants' LoRA adapters on the engines, loaded on demand.

Per pool and replica, under the pool's hash tag (``ip:{p:<pool>}:``), so the admission
script can prefer replicas that already hold a request's adapter:
  lora:<replica>               zset   engine-side adapter name -> last used (ms): what it holds
  lora_use:<replica>:<name>    zset   request id -> until when it counts as using the adapter
  lora_lock:<replica>          string the one process loading onto that replica (single flight)
  lora_stats                   hash   "<replica>|loads" / "<replica>|evictions" counters

A request counts as using its adapter from routing until the engine has its request (or for
USE_MS at most: vLLM's unload only forgets the name, so once the engine runs a request,
evicting the adapter cannot hurt it, and a crashed gateway's marks expire by themselves).
A request whose replica lacks its adapter loads it (``POST /v1/load_lora_adapter``) under
the replica's lock; requests arriving meanwhile wait for that load instead of starting their
own. A replica holding ``max_loras`` adapters first unloads its least recently used one that
no request is using; choosing and claiming it is one script, so a request cannot start using
an adapter that is being evicted. Times come from Redis's clock (one clock for every host).
The health probe reconciles these sets with each engine's ``/v1/models``
(``inference.services.probes``).

Failures: an engine that cannot be reached is a replica failure (the caller fails over); an
engine that refuses the adapter fails only that request (503 ``adapter_load_failed``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import aiohttp
from redis.exceptions import RedisError

from inference.catalog import adapters_held_key, pool_prefix
from inference.engine_auth import engine_auth_headers
from inference.gateway.call import Adapter, Call
from inference.gateway.errors import ApiError, overloaded
from inference.gateway.lua import Batch, Script
from inference.gateway.redis import redis_async
from inference.gateway.upstream import TRANSPORT_ERRORS, engine_session

log = logging.getLogger(__name__)

POST_SECONDS = 30.0  # one load or unload on an engine
LOCK_MS = 150_000  # longer than the worst locked section: an unload and a load
WAIT_SECONDS = 120.0  # longest a request waits for another request's load on its replica
USE_MS = 60_000  # a request's "using this adapter" mark, if nothing removes it before
POLL_SECONDS = 0.02


# KEYS: held, use   ARGV: name, rid, use_ms  ->  1 if the replica holds the adapter
_USE = Script("lora", "use")

# KEYS: held   ARGV: keep, capacity, use-key prefix
#   -> the adapter claimed for eviction (already out of the held set); '' when there is room;
#      false when every held adapter is in use (load over capacity; a later load evicts)
_CLAIM_VICTIM = Script("lora", "claim_victim")

# KEYS: held, stats   ARGV: name, stats field
_LOADED = Script("lora", "loaded")

_UNLOCK = Script("lora", "unlock")

# KEYS: held   ARGV: probe began (ms), the adapters the engine lists  (the health probe's,
# run synchronously by inference.services.probes: what the router believes, made what the engine
# holds)
RECONCILE = Script("lora", "reconcile")


class ReplicaUnreachable(Exception):
    """The engine could not be reached to load or unload: a replica failure."""


def adapter_refused(message: str) -> ApiError:
    log.error("engine refused a LoRA adapter operation: %s", message)
    return ApiError(
        503,
        "The adapter could not be loaded onto the engine (the engine refused it; the "
        "platform operator can see why in the logs). Retrying will not help until that "
        "is fixed.",
        type="server_error",
        code="adapter_load_failed",
        kind="adapter_load",
    )


def _use_key(pool: str, replica: str, name: str) -> str:
    return f"{pool_prefix(pool)}lora_use:{replica}:{name}"


def _lock_key(pool: str, replica: str) -> str:
    return f"{pool_prefix(pool)}lora_lock:{replica}"


def stats_key(pool: str) -> str:
    return f"{pool_prefix(pool)}lora_stats"


async def use(pool: str, replica: str, name: str, rid: str) -> bool:
    """Mark the request as using the adapter on the replica (it is not evicted meanwhile)
    and the adapter as recently used; whether the replica already holds it."""
    keys = [adapters_held_key(pool, replica), _use_key(pool, replica, name)]
    held = await _USE(keys=keys, args=[name, rid, USE_MS])
    return bool(held)


async def unuse(pool: str, replica: str, name: str, rid: str) -> None:
    await redis_async().zrem(_use_key(pool, replica, name), rid)


def unuse_into(pipe: Batch, pool: str, replica: str, name: str, rid: str) -> None:
    pipe.zrem(_use_key(pool, replica, name), rid)


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
                    await _LOADED(keys=[key, stats_key(pool)], args=[name, f"{replica}|loads"])
                    log.info("loaded adapter %s on %s", name, url)
                return
            finally:
                await _UNLOCK(keys=[lock], args=[token])
        await asyncio.sleep(POLL_SECONDS)
        if await client.zscore(key, name) is not None:
            return
        if time.monotonic() > deadline:
            raise ApiError(
                503,
                "The adapter is still being loaded. Retry shortly.",
                type="server_error",
                code="adapter_loading",
                headers={"retry-after": "5"},
                kind="adapter_load",
            )


async def _make_room(pool: str, replica: str, url: str, *, keep: str, capacity: int) -> None:
    """Unload least recently used adapters no request is using until one more fits."""
    held_key = adapters_held_key(pool, replica)
    use_prefix = f"{pool_prefix(pool)}lora_use:{replica}:"
    while True:
        victim = await _CLAIM_VICTIM(keys=[held_key], args=[keep, capacity, use_prefix])
        if not victim:  # room ('') or every one in use (None): load anyway
            return
        name = victim.decode() if isinstance(victim, bytes) else str(victim)
        await unload(url, name)
        await redis_async().hincrby(stats_key(pool), f"{replica}|evictions", 1)
        log.info("evicted adapter %s from %s", name, url)


async def unload(url: str, name: str) -> None:
    """Unload from one engine; one that no longer holds it is fine."""
    await _post(url, "/v1/unload_lora_adapter", {"lora_name": name}, missing_ok=True)


async def _post(url: str, path: str, body: dict[str, str], *, missing_ok: bool = False) -> None:
    try:
        async with engine_session().post(
            url + path,
            json=body,
            headers=engine_auth_headers(),
            timeout=aiohttp.ClientTimeout(total=POST_SECONDS),
        ) as response:
            text = (await response.read()).decode(errors="replace")
    except TRANSPORT_ERRORS as exc:
        raise ReplicaUnreachable(f"{path} on {url}: {type(exc).__name__}: {exc}") from exc
    if response.status == 200:
        return
    if missing_ok and response.status == 404:
        return
    if response.status == 400 and "already been loaded" in text:
        return  # loaded by someone who could not record it (e.g. Redis was flushed)
    raise adapter_refused(f"{path} on {url}: HTTP {response.status}: {text[:300]}")


def adapters_held(pool: str, replicas: list[str]) -> dict[str, list[str]]:
    """The engine-side names of the adapters each replica holds (synchronous, for the
    dashboard; RedisError if Redis is unreachable)."""
    from controlplane.redis import redis_sync

    pipe = redis_sync().pipeline(transaction=False)
    for replica in replicas:
        pipe.zrange(adapters_held_key(pool, replica), 0, -1)
    return {
        replica: [name.decode() for name in names]
        for replica, names in zip(replicas, pipe.execute(), strict=True)
    }


async def onto_replica(call: Call, adapter: Adapter) -> None:
    """Make sure the chosen replica holds the request's adapter (loading it if not), and
    count the request as using it there, so that it is not evicted meanwhile (a failure
    fails the call: the error the client gets is raised)."""
    pool = call.route.pool
    try:
        held = False
        if call.route.adapter_replica != call.route.replica:
            if call.route.adapter_replica:
                await unuse(pool, call.route.adapter_replica, adapter.engine_name, call.rid)
            call.route.adapter_replica = call.route.replica  # before: finish() unmarks it whatever
            held = await use(pool, call.route.replica, adapter.engine_name, call.rid)
        if not held:
            await load(
                pool=pool,
                replica=call.route.replica,
                url=call.route.replica_url,
                name=adapter.engine_name,
                path=adapter.path,
                capacity=call.route.max_loras,
            )
    except RedisError:
        log.warning("adapter bookkeeping unavailable", exc_info=True)
        call.fail("adapter bookkeeping unavailable")
        call.error_kind = "adapter_load"
        raise overloaded(
            2, "Adapters cannot be placed for a moment. Retry shortly.", kind="adapter_load"
        ) from None
    except ApiError as exc:  # the engine refused the adapter, or its load takes too long
        call.fail(exc.message)
        call.error_kind = exc.kind
        raise


async def forget_quietly(call: Call, adapter: Adapter) -> None:
    """The call's replica turned out not to hold the adapter (it restarted since the last
    probe): forgotten there, so that the next placement loads it again."""
    try:
        await forget(call.route.pool, call.route.replica, adapter.engine_name)
    except RedisError:
        log.warning("could not forget adapter %s", adapter.engine_name, exc_info=True)
