"""Keeping a process's copy of something published in Redis fresh without polling it.

A publisher writes its snapshot and a version, then ``PUBLISH``es on a channel
(``changed``). Each web process holds one subscription per watched channel: a message
wakes it to compare the version and fetch what moved, and between changes the process
spends nothing (a subscribed connection just waits; Redis pings it every
``health_check_interval``). A message cannot be missed silently: Redis drops a lagging
subscriber's connection rather than its messages, and every (re)subscription is followed
by one look at the version, which catches whatever was published while it was away. A
look every ``quiet_seconds`` anyway covers a connection that died without a word.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from controlplane.redis import channel
from inference.gateway.redis import redis_async

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0  # after a failed look or a lost subscription


async def watch_forever(
    name: str,
    look: Callable[[list[bytes]], Awaitable[None]],
    *,
    quiet_seconds: Callable[[], float],
    what: str,
) -> None:
    """Subscribe to the channel ``name`` of this Redis database (``channel``); call
    ``look`` once subscribed, on every message (a burst makes one look, given all its
    messages' data) and after ``quiet_seconds()`` without one (given none). A failed look or
    subscription is retried each second (the process keeps serving from what it has)."""
    while True:
        pubsub = redis_async().pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel(name))
            await look([])  # what was published before the subscription took
            while True:
                message = await pubsub.get_message(timeout=quiet_seconds())
                burst: list[bytes] = []
                while message is not None:  # drain a burst: one look for all of it
                    if message.get("type") == "message":
                        burst.append(message["data"])
                    message = await pubsub.get_message(timeout=0)
                await look(burst)
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
