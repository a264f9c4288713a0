"""A request's slot: admitted (or queued until granted), lent by an online pool, given back,
rerouted. ``Admission`` is the process's one object (``admission()``, per event loop)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisError

from inference.catalog import pool_prefix
from inference.gateway.admission.grants import Grants
from inference.gateway.admission.scripts import (
    CANCEL,
    DEFAULT_BAND,
    ENQUEUE,
    LEND,
    PROGRESS,
    REROUTE,
    SUSPECT,
    W_IN,
    W_OUT,
)
from inference.gateway.errors import overloaded
from inference.gateway.lua import Batch, Script

log = logging.getLogger(__name__)


class CatalogMissing(Exception):
    """Redis has no capacity record for the pool (it was flushed): publish and retry."""


class Alongside(Protocol):
    """A script to send beside ENQUEUE (``Admission.admit``): ``limits.Plan``. Its result
    is kept in ``result`` (an exception when it failed)."""

    keys: list[str]
    args: list[Any]
    result: Any

    @property
    def script(self) -> Script: ...

    def taken(self, result: Any) -> bool: ...


class NotTaken(Exception):
    """The script sent beside ENQUEUE did not say taken; ENQUEUE's work was undone."""

    def __init__(self, result: Any) -> None:
        super().__init__("not taken")
        self.result = result


async def _enqueue(
    keys: list[str], args: list[Any], alongside: Alongside | None
) -> tuple[Any, Any]:
    """ENQUEUE, and ``alongside`` before it in the same round trip: (its result, ENQUEUE's).
    A pipeline on one Redis; on a cluster, each node its part at once."""
    if alongside is None:
        return None, await ENQUEUE(keys=keys, args=args)
    batch = Batch()
    batch.script(alongside.script, alongside.keys, alongside.args)
    batch.script(ENQUEUE, keys, args)
    first, second = await batch.execute(raise_errors=False)
    alongside.result = first
    if isinstance(second, Exception):
        raise second
    return first, second


async def _second(sent: asyncio.Future[tuple[Any, Any]]) -> Any:
    """ENQUEUE's result, of ``_enqueue``'s two."""
    return (await sent)[1]


@dataclass
class Admission(Grants):
    """This process's side of admission: requests admitted, lent room, given back."""

    async def admit(
        self,
        *,
        pool: str,
        rid: str,
        tenant: int,
        weight: int,
        prompt_estimate: int,
        prefix: str,
        wait_seconds: float,
        limit_keys: tuple[str, ...],
        limit_member: str = "",
        adapter: str = "",
        sequences: int = 1,
        band: int = DEFAULT_BAND,
        alongside: Alongside | None = None,
    ) -> str:
        """Wait for a slot; the replica id to send the request to. 503 after the wait.

        ``alongside``: a script sent with ENQUEUE in the same round trip (the limits'
        ACQUIRE, whose keys are in another slot); when it does not say taken, whatever
        ENQUEUE did is undone and ``NotTaken`` carries its result."""
        self._start(pool)
        base = pool_prefix(pool)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiters[rid] = future
        self.waiting[pool] += 1
        # The limits' leases are renewed from now on, while the request waits too (a wait
        # may outlast a lease).
        self.held[rid] = (pool, limit_keys, limit_member or rid)
        granted = False
        try:
            # The script runs whole or not at all: a cancel while its answer is on the way
            # (a guard check out of its budget, a client gone) must not leave a slot it may
            # have granted held by nobody until its lease runs out (LEASE_MS, for everyone).
            args = self._args(
                rid,
                tenant,
                weight,
                W_IN * prompt_estimate,
                self.proc,
                prefix,
                int(wait_seconds * 1000),
                adapter,
                sequences,
                band,
            )
            sent = asyncio.ensure_future(_enqueue([base], args, alongside))
            try:
                beside, result = await asyncio.shield(sent)
            except asyncio.CancelledError:
                undo = self._undo_enqueue(pool, rid, _second(sent), future)
                await asyncio.shield(undo)
                raise
            if alongside is not None and not alongside.taken(beside):
                # The limits refused it: a request that never was, whose admission is undone
                # with no service charged and no slot held for its tenant.
                undo = self._undo_enqueue(pool, rid, _second(sent), future, W_IN * prompt_estimate)
                try:
                    await asyncio.shield(undo)
                except RedisError:  # what it holds ends with its lease
                    log.warning("could not undo the admission of %s", rid, exc_info=True)
                raise NotTaken(beside)
            state, replica = str(result[0].decode()), str(result[1].decode())
            if state == "nocatalog":
                raise CatalogMissing(pool)
            if state == "granted":
                granted = True
                return replica
            if pool in self.listening_idle:
                self._tick_meanwhile(pool)
            try:
                replica = str(await asyncio.wait_for(asyncio.shield(future), timeout=wait_seconds))
            except asyncio.CancelledError:
                await asyncio.shield(self._leave(pool, rid, future))
                raise
            except TimeoutError:
                try:  # a cancel now (a line leaving for lent room) must not drop a grant
                    replica = await asyncio.shield(self._withdraw(pool, rid, future))
                except asyncio.CancelledError:
                    await asyncio.shield(self._leave(pool, rid, future))
                    raise
                if not replica:
                    raise overloaded(max(1, int(wait_seconds / 4)), kind="queue_timeout") from None
            granted = True
            return replica
        finally:
            if not granted:
                self.held.pop(rid, None)
            self.waiters.pop(rid, None)
            self.waiting[pool] -= 1

    async def borrow(
        self,
        *,
        pool: str,
        rid: str,
        tenant: int,
        weight: int,
        prompt_estimate: int,
        prefix: str,
        limit_keys: tuple[str, ...],
        limit_member: str = "",
        adapter: str = "",
        sequences: int = 1,
    ) -> str:
        """Room an online pool lends a batch line now, in the lowest band: the replica, or
        "" when the pool lends none now (it never waits). A lent request's ``reclaimed``
        event is set when online demand takes the room back; the caller then aborts it."""
        self._start(pool)
        # Before the script runs: a reclaim may reach the listener before the answer here.
        event = self.reclaimed[rid] = asyncio.Event()
        self.held[rid] = (pool, limit_keys, limit_member or rid)
        granted = False
        try:
            lending = asyncio.ensure_future(
                LEND(
                    keys=[pool_prefix(pool)],
                    args=self._args(
                        rid,
                        tenant,
                        weight,
                        W_IN * prompt_estimate,
                        self.proc,
                        prefix,
                        adapter,
                        sequences,
                    ),
                )
            )
            try:
                result = await asyncio.shield(lending)
            except asyncio.CancelledError:  # as ``admit``: a room lent meanwhile is given back
                await asyncio.shield(self._undo_borrow(pool, rid, lending))
                raise
            state, replica = result[0].decode(), result[1].decode()
            if state == "nocatalog":
                raise CatalogMissing(pool)
            granted = state == "granted"
            return replica if granted else ""
        finally:
            if not granted:
                self.held.pop(rid, None)
                if self.reclaimed.get(rid) is event:
                    del self.reclaimed[rid]

    async def lendable(
        self, *, pool: str, prefix: str, adapter: str = "", sequences: int = 1
    ) -> bool:
        """Whether ``pool`` would lend room now (``borrow`` would be granted); lends none.
        A batch line waiting in its own pool's queue asks this before it leaves the queue
        for lent room: the two never hold the same request at once."""
        result = await LEND(
            keys=[pool_prefix(pool)],
            args=self._args("", 0, 0, 0, self.proc, prefix, adapter, sequences, 1),
        )
        return bool(result[0].decode() == "room")

    async def _undo_borrow(self, pool: str, rid: str, lending: asyncio.Future[Any]) -> None:
        try:
            result = await lending
        except (RedisError, asyncio.CancelledError):
            return  # it did not run (or we cannot know: the lease reaper frees it)
        if result[0].decode() == "granted":
            await self.complete(pool=pool, rid=rid, adjustment=0)

    async def _undo_enqueue(
        self,
        pool: str,
        rid: str,
        enqueue: Awaitable[Any],
        future: asyncio.Future[str],
        refund: float = 0,
    ) -> None:
        """The caller was cancelled while its ENQUEUE ran: whatever the script did (granted,
        queued, nothing) is undone. ``refund``: a request that never was (its limits
        refused it) gives back the service its grant charged, and keeps no slot held for
        its tenant."""
        try:
            result = await enqueue
        except (RedisError, asyncio.CancelledError):
            return  # it did not run (or we cannot know: the lease reaper frees it)
        state = result[0].decode()
        if state == "granted":
            await self.complete(pool=pool, rid=rid, adjustment=-refund, hold=not refund)
        elif state != "nocatalog":
            await self._leave(pool, rid, future, refund)

    async def _leave(
        self, pool: str, rid: str, future: asyncio.Future[str], refund: float = 0
    ) -> None:
        """Out of the queue, and the slot given back if a grant won the race (``refund``:
        see ``_undo_enqueue``)."""
        if await self._withdraw(pool, rid, future):
            await self.complete(pool=pool, rid=rid, adjustment=-refund, hold=not refund)

    async def _withdraw(self, pool: str, rid: str, future: asyncio.Future[str]) -> str:
        """Leave the queue; if the grant won the race, the replica it carries."""
        result = await CANCEL(keys=[pool_prefix(pool)], args=self._args(rid))
        if result[0].decode() != "granted":
            return ""
        # The grant is on its way to our listener; take it here and tell the listener.
        self.claimed.add(rid)
        if future.done():
            self.claimed.discard(rid)
        return str(result[1].decode())

    async def progress(self, *, pool: str, rid: str, completion_tokens: int) -> None:
        await PROGRESS(keys=[pool_prefix(pool)], args=self._args(rid, W_OUT * completion_tokens))

    async def reroute(self, *, pool: str, rid: str, failed: str) -> str | None:
        """The replica failed before answering: take it out of rotation, try another. ""
        when none can take it; None when the request holds no room here any more (its lent
        room was taken back meanwhile, or its lease ran out)."""
        result = await REROUTE(keys=[pool_prefix(pool)], args=self._args(rid, failed))
        replica = result.decode() if isinstance(result, bytes) else str(result)
        if replica in ("", "-"):
            self.held.pop(rid, None)
        return None if replica == "-" else replica

    async def suspect(self, *, pool: str, replica: str) -> bool:
        """A replica went silent mid-stream: no new requests go there until a probe (whose
        catalog publish restores the ready set) finds it answering again."""
        left = await SUSPECT(keys=[pool_prefix(pool)], args=self._args(replica))
        return bool(left)


_admissions: dict[asyncio.AbstractEventLoop, Admission] = {}


def admission() -> Admission:
    loop = asyncio.get_running_loop()
    found = _admissions.get(loop)
    if found is None:
        found = _admissions[loop] = Admission()
    return found
