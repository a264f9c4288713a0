"""Keeping a process's copy of something published in Redis fresh without polling it.

A publisher writes its snapshot and a version, then ``SPUBLISH``es on a channel
(``changed``; sharded pub/sub, Redis 7: on a cluster only the channel's shard carries it).
Each web process holds one subscription per watched channel: a message wakes it to compare
the version and fetch what moved, and between changes the process spends nothing (a
subscribed connection just waits; Redis pings it every ``health_check_interval``). A message
cannot be missed silently: Redis drops a lagging subscriber's connection rather than its
messages, and every (re)subscription is followed by one look at the version, which catches
whatever was published while it was away. A look every ``quiet_seconds`` anyway covers a
connection that died without a word.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from controlplane.redis import APPLIED_SECONDS, announced_keys, channel
from inference.gateway.redis import client_ready, redis_async

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0  # after a failed look or a lost subscription


async def _applied(tag: str | None, versions: list[bytes], what: str) -> None:
    """Count this process among those that applied ``versions`` (``applied_wait``), which
    are then forgotten (a count lost to Redis is only a waiter's)."""
    if tag is None or not versions:
        return
    pipe = redis_async().pipeline(transaction=False)
    for version in versions:
        applied = announced_keys(tag, version.decode())[1]
        pipe.incr(applied)
        pipe.expire(applied, APPLIED_SECONDS)
    versions.clear()
    try:
        await pipe.execute()
    except RedisError:  # only a waiter misses it (and says so); serving goes on
        log.warning("could not say %s was applied", what, exc_info=True)


_watching: dict[asyncio.AbstractEventLoop, set[asyncio.Task[object]]] = {}


async def watches_end() -> None:
    """End the running loop's watches, their subscriptions closed. For a process whose loop
    stops between pieces of work (the batch runner): subscribed, it would read nothing until
    its next run and still be counted among the listeners (``catalog_applied``). A view
    starts its watch again when next used, and looks at the version first."""
    tasks = _watching.pop(asyncio.get_running_loop(), set())
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def watch_forever(
    name: str,
    look: Callable[[list[bytes]], Awaitable[None]],
    *,
    quiet_seconds: Callable[[], float],
    what: str,
    tag: str | None = None,
) -> None:
    """Subscribe to the channel ``name`` of this Redis database (``channel``); call
    ``look`` once subscribed, on every message (a burst makes one look, given all its
    messages' data) and after ``quiet_seconds()`` without one (given none). A failed look or
    subscription is retried each second (the process keeps serving from what it has).
    With ``tag``, a message that is a version number is counted applied by this process
    once its look is done (``controlplane.redis.applied_wait``)."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    if task is not None:
        _watching.setdefault(loop, set()).add(task)
    try:
        await _watch(name, look, quiet_seconds=quiet_seconds, what=what, tag=tag)
    finally:
        watching = _watching.get(loop, set())
        watching.discard(task)
        if not watching:
            _watching.pop(loop, None)


async def _watch(
    name: str,
    look: Callable[[list[bytes]], Awaitable[None]],
    *,
    quiet_seconds: Callable[[], float],
    what: str,
    tag: str | None,
) -> None:
    # Versions announced to this process that no look has applied yet (one failed): the next
    # look that succeeds, on a new subscription if need be, counts them.
    pending: list[bytes] = []
    while True:
        try:
            pubsub = (await client_ready(redis_async())).pubsub()
        except (RedisError, OSError):
            log.warning("could not keep %s fresh (Redis): retrying", what, exc_info=True)
            await asyncio.sleep(RETRY_SECONDS)
            continue
        # A cluster's subscriptions are read from the shard's node (a connection of its own).
        read = getattr(pubsub, "get_sharded_message", pubsub.get_message)
        try:
            await pubsub.ssubscribe(channel(name))
            await look([])  # what was published before the subscription took
            await _applied(tag, pending, what)
            while True:
                message = await read(timeout=quiet_seconds())
                burst: list[bytes] = []
                while message is not None:  # drain a burst: one look for all of it
                    if message.get("type") == "smessage":
                        burst.append(message["data"])
                    elif message.get("type") == "sunsubscribe":  # its slot moved: subscribe anew
                        raise RedisConnectionError(f"{name}: the shard ended the subscription")
                    message = await read(timeout=0)
                if tag is not None:
                    pending += [m for m in burst if m.isdigit()]
                await look(burst)
                await _applied(tag, pending, what)
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError):
            log.warning("could not keep %s fresh (Redis): retrying", what, exc_info=True)
        except Exception:  # the database may be away; keep serving from the last copy
            log.warning("could not keep %s fresh: retrying", what, exc_info=True)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
        await asyncio.sleep(RETRY_SECONDS)
