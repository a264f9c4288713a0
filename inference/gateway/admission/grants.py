"""A process's side of admission: the grants its requests wait for, and its background tasks.

Each pool has one listener per process, blocked on the process's grants list (``BLPOP``):
a grant wakes the request waiting for it, or is given back when nobody waits any more; a
lent request's reclaim sets its event. While requests wait, the listener releases expired
holds every ``TICK_SECONDS``. The renewer keeps the leases (admission's and the limits') of
every request the process holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from inference.catalog import pool_prefix
from inference.gateway.admission import scripts
from inference.gateway.admission.scripts import COMPLETE, RENEW, TICK
from inference.gateway.lua import Batch
from inference.gateway.redis import LISTEN_IDLE_SECONDS, redis_async, redis_async_blocking

log = logging.getLogger(__name__)


@dataclass
class Grants:
    """What this process keeps of admission: the grants its requests wait for (one listener
    per pool), the leases it renews, the slots it gives back."""

    proc: str = field(default_factory=lambda: uuid.uuid4().hex)
    waiters: dict[str, asyncio.Future[str]] = field(default_factory=dict)
    # rid -> (pool, the limits' in-flight leases it holds, its name in them)
    held: dict[str, tuple[str, tuple[str, ...], str]] = field(default_factory=dict)
    claimed: set[str] = field(default_factory=set)
    waiting: Counter[str] = field(default_factory=Counter)
    listeners: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # Pools whose listener is in a long wait (nobody was waiting when it began), and the
    # tasks that release expired holds for the requests that came to wait meanwhile.
    listening_idle: set[str] = field(default_factory=set)
    tickers: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    renewer: asyncio.Task[None] | None = None
    # rid -> set when the online pool takes back the room it lent the request (``borrow``)
    reclaimed: dict[str, asyncio.Event] = field(default_factory=dict)

    def _args(self, *args: str | int | float) -> list[str | int | float]:
        return [scripts.LEASE_MS, scripts.ROUTE_SLACK, *args]

    async def complete(self, *, pool: str, rid: str, adjustment: float, hold: bool = True) -> None:
        """Free the slot; ``adjustment`` is the weighted service not yet charged. ``hold``:
        the slot may be kept a moment for the tenant's next request (``HOLD_MS``)."""
        self.held.pop(rid, None)
        self.reclaimed.pop(rid, None)
        args = self._args(rid, adjustment, *(() if hold else ("nohold",)))
        await COMPLETE(keys=[pool_prefix(pool)], args=args)

    def complete_into(self, pipe: Batch, *, pool: str, rid: str, adjustment: float) -> None:
        self.held.pop(rid, None)
        self.reclaimed.pop(rid, None)
        pipe.script(COMPLETE, [pool_prefix(pool)], self._args(rid, adjustment))

    # --- background tasks --------------------------------------------------------------

    def _start(self, pool: str) -> None:
        if pool not in self.listeners or self.listeners[pool].done():
            self.listeners[pool] = asyncio.create_task(self._listen(pool))
        if self.renewer is None or self.renewer.done():
            self.renewer = asyncio.create_task(self._renew())

    async def _listen(self, pool: str) -> None:
        base = pool_prefix(pool)
        key = base + "grants:" + self.proc
        while True:
            waiting = self.waiting[pool] > 0
            # With requests waiting, a short wait, after which expired holds are released;
            # otherwise a long one (a grant ends it at once: only its idle cost is at stake),
            # and a request that comes to wait meanwhile has a ticker of its own.
            if waiting:
                self.listening_idle.discard(pool)
            else:
                self.listening_idle.add(pool)
            try:
                # (the long wait on a client whose socket outwaits it; the short one on the
                # shared client, which gives up on a dead connection within seconds)
                if waiting:
                    item = await redis_async().blpop([key], timeout=scripts.TICK_SECONDS)
                else:
                    item = await redis_async_blocking().blpop([key], timeout=LISTEN_IDLE_SECONDS)
                if item is None and waiting:
                    # Nothing came: release held slots whose tenant did not return.
                    await TICK(keys=[base], args=self._args())
            except RedisError:
                log.warning("admission listener for %s lost Redis; retrying", pool)
                await asyncio.sleep(0.5)
                continue
            if item is None:
                continue
            grant = item[1]
            text = grant.decode() if isinstance(grant, bytes) else str(grant)
            if text.startswith("!"):  # lent room taken back (``reclaim``): its slot is gone
                event = self.reclaimed.get(text[1:])
                if event is not None:
                    event.set()
                continue
            rid, _, replica = text.partition("|")
            future = self.waiters.get(rid)
            if rid in self.claimed:
                self.claimed.discard(rid)
            elif future is not None and not future.done():
                future.set_result(replica)
            else:  # nobody waits any more (left, timed out): give the slot back at once
                with contextlib.suppress(RedisError):
                    await self.complete(pool=pool, rid=rid, adjustment=0)

    def _tick_meanwhile(self, pool: str) -> None:
        if pool not in self.tickers or self.tickers[pool].done():
            self.tickers[pool] = asyncio.create_task(self._tick_while_listening_idle(pool))

    async def _tick_while_listening_idle(self, pool: str) -> None:
        """What the listener does between grants while requests wait, for as long as it is
        in its long wait: release expired holds every TICK_SECONDS."""
        base = pool_prefix(pool)
        while self.waiting[pool] > 0 and pool in self.listening_idle:
            await asyncio.sleep(scripts.TICK_SECONDS)
            if self.waiting[pool] > 0 and pool in self.listening_idle:
                with contextlib.suppress(RedisError):
                    await TICK(keys=[base], args=self._args())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(scripts.RENEW_EVERY)
            if not self.held:
                continue
            by_pool: dict[str, list[str]] = {}
            limit_keys: dict[str, list[str]] = {}
            for rid, (pool, keys, member) in list(self.held.items()):
                by_pool.setdefault(pool, []).append(rid)
                for k in keys:
                    limit_keys.setdefault(k, []).append(member)
            try:
                for pool, rids in by_pool.items():
                    await RENEW(keys=[pool_prefix(pool)], args=self._args(*rids))
                client = redis_async()
                pipe = client.pipeline(transaction=False)
                expiry = await client.time()
                until = expiry[0] * 1000 + expiry[1] // 1000 + scripts.LEASE_MS
                for k, members in limit_keys.items():
                    pipe.zadd(k, dict.fromkeys(members, until), xx=True)
                    pipe.pexpire(k, 2 * scripts.LEASE_MS)  # the set outlives its longest lease
                await pipe.execute()
            except RedisError:
                log.warning("could not renew admission leases", exc_info=True)
