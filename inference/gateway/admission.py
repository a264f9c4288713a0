"""Token-weighted fair admission (Virtual Token Counter) over Redis, global across processes.

Per pool, under one hash tag (``ip:{p:<pool>}:``), with ``<b>`` a priority band (0 first):
  counters:<b>  hash   tenant -> virtual token counter (weighted service received in the band)
  active        hash   tenant -> requests running (or holding a slot)
  idle_since    hash   tenant -> when it last had nothing running
  holds         zset   "tenant|replica|rid" -> expiry: slots kept for a returning tenant
  backlog:<b>   zset   the band's backlogged tenants, scored by counter
  q:<b>:<tenant> list  that tenant's waiting request ids in the band (``fcfs:<b>``: one list)
  passed        hash   band -> admissions of higher bands since it last had one, while it waited
  req:<rid>     hash   tenant, weight, estimate, sequences, process, prefix, deadline, state,
                       replica, band
  inflight      zset   admitted request ids by lease expiry (renewed while they run)
  replicas      hash   ready replica id -> capacity (``catalog_publish`` writes it)
  rload         hash   replica id -> sequences in flight (a request runs prompts x n of them)
  grants:<proc> list   admitted request ids for the web process that holds the connection
                       ("rid|replica"), or lent ones it lost ("!rid")
  lend          string the percent of the pool's capacity it lends batch lines (the catalog's)
  lent          zset   request ids running on lent room, in the order lent (lent_serial)
  lent_seqs     string the sequences they run
  lending       hash   lent / reclaimed: how many requests were lent room, and lost it

Capacity counts sequences, not requests: a request of 8 prompts with n=2 takes 16 of a
replica's ``max_inflight`` slots (one larger than a replica is refused before it gets here),
so no request shape can put more work on an engine than its share.

Bands are served in strict order (a request's band is its priority class, see
``inference.gateway.priority``), except for the starvation guard: a lower band passed over
``SHARE - 1`` admissions in a row while it waited takes the next one, so a flood at the top
leaves every lower band at least one admission in ``SHARE``. Inside a band, admitting picks
the backlogged tenant with the smallest counter, charges it
``w_in·prompt_estimate / weight`` and routes the request (least loaded replica; among
near-least-loaded ones, rendezvous hashing of the prompt's prefix for cache affinity; for a
LoRA adapter, the least loaded replica already holding it, see ``inference.gateway.lora``).
Output tokens are charged as they stream (PROGRESS); COMPLETE reconciles the estimate with
the engine's count, frees the slot and admits the next request. A tenant that becomes
backlogged after being idle (nothing queued, nothing running) has its counter lifted to the
smallest backlogged counter, so idle time earns no credit. When a request ends and its
tenant is owed service but has nothing queued yet (a client about to send its next request),
the slot is held for that tenant for HOLD_MS before anyone else gets it. Leases of a crashed
process expire and are reaped.

An online pool may lend its idle room to batch lines (``borrow``, ``lend.lua``): granted at
once in the lowest band while nothing waits in any band and the lent sequences stay within the
pool's share, else refused at once (the line waits in its spot pool's queue, asking
``lendable`` meanwhile). A request that finds no
room takes lent room back first (``reclaim``): the newest lent request's slot is freed in the
same script and its process told, which aborts it on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from redis.exceptions import RedisError

from inference.catalog import pool_prefix
from inference.gateway.errors import overloaded
from inference.gateway.lua import Batch, Script
from inference.gateway.redis import LISTEN_IDLE_SECONDS, redis_async, redis_async_blocking
from tenants.priority import DEFAULT_CLASS, PRIORITY_CLASSES

log = logging.getLogger(__name__)

LEASE_MS = 20_000
RENEW_EVERY = 5.0
W_IN, W_OUT = 1, 2  # weighted service = prompt + 2 x completion tokens
ROUTE_SLACK = 1  # replicas within this many requests of the least loaded count as "least"
HOLD_MS = 100  # how long a completed request's slot is kept for its tenant's next request
TICK_SECONDS = 0.05  # how often a process with waiting requests releases expired holds
IDLE_GRACE_MS = 1000  # a pause shorter than this between a tenant's requests is not idleness
# A request that does not fit yet lets others that fit go past it for this long, then
# waits for its room with nobody passing it; the next tenants looked at for one that fits.
BACKFILL_MS = 2000
BACKFILL_SCAN = 8
BANDS, DEFAULT_BAND = len(PRIORITY_CLASSES), PRIORITY_CLASSES.index(DEFAULT_CLASS)
SHARE = 10  # the starvation guard: a waiting lower band gets at least 1 admission in SHARE
# The Lua scripts' (inference/gateway/lua/admission/) numbers, from here.
_CONSTANTS = {
    "BANDS": BANDS,
    "DEFAULT_BAND": DEFAULT_BAND,
    "SHARE": SHARE,
    "HOLD": HOLD_MS,
    "IDLE_GRACE": IDLE_GRACE_MS,
    "BACKFILL": BACKFILL_MS,
    "BACKFILL_SCAN": BACKFILL_SCAN,
}


# ARGV: lease slack rid tenant weight est proc prefix wait_ms adapter seqs band
ENQUEUE = Script("admission", "enqueue", constants=_CONSTANTS)

# ARGV: lease slack rid tenant weight est proc prefix adapter seqs [probe]
#   -> {'granted', replica} | {'no', why} | {'nocatalog', ''}: room lent at once, or none;
#      with probe '1', {'room', replica} instead of a grant (nothing lent: ``lendable``)
LEND = Script("admission", "lend", constants=_CONSTANTS)

# ARGV: lease slack  ->  held slots left (expired holds are released, waiters admitted)
TICK = Script("admission", "tick", constants=_CONSTANTS)

# ARGV: lease slack rid amount
PROGRESS = Script("admission", "progress", constants=_CONSTANTS)

# ARGV: lease slack rid adjustment [nohold]
COMPLETE = Script("admission", "complete", constants=_CONSTANTS)

# ARGV: lease slack rid  ->  {'cancelled'|'granted'|'gone', replica}
CANCEL = Script("admission", "cancel", constants=_CONSTANTS)

# ARGV: lease slack rid failed_replica
#   -> another replica id; the same id (it is the only one left: retry it, the health probe
#      decides whether it is down); '' (no room anywhere: the slot is released); or '-' (the
#      request holds no slot any more: its lent room was taken back, or its lease ran out)
REROUTE = Script("admission", "reroute", constants=_CONSTANTS)

# ARGV: lease slack replica  ->  1 if it left the rotation (the pool's last one stays: the
# health probe decides; the next catalog publish brings back a replica the probe finds well)
SUSPECT = Script("admission", "suspect", constants=_CONSTANTS)

# ARGV: lease slack rid...
RENEW = Script("admission", "renew", constants=_CONSTANTS)


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
class Admission:
    """This process's side of admission: waits for grants, renews leases."""

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
        return [LEASE_MS, ROUTE_SLACK, *args]

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
                    item = await redis_async().blpop([key], timeout=TICK_SECONDS)
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
            await asyncio.sleep(TICK_SECONDS)
            if self.waiting[pool] > 0 and pool in self.listening_idle:
                with contextlib.suppress(RedisError):
                    await TICK(keys=[base], args=self._args())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY)
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
                until = expiry[0] * 1000 + expiry[1] // 1000 + LEASE_MS
                for k, members in limit_keys.items():
                    pipe.zadd(k, dict.fromkeys(members, until), xx=True)
                    pipe.pexpire(k, 2 * LEASE_MS)  # the set outlives its longest lease
                await pipe.execute()
            except RedisError:
                log.warning("could not renew admission leases", exc_info=True)


_admissions: dict[asyncio.AbstractEventLoop, Admission] = {}


def admission() -> Admission:
    loop = asyncio.get_running_loop()
    found = _admissions.get(loop)
    if found is None:
        found = _admissions[loop] = Admission()
    return found


# --- readers, for the dashboard and commands (synchronous) --------------------------------


@dataclass(frozen=True)
class QueueState:
    """A pool's admission state right now."""

    in_flight: dict[str, int]  # replica id -> sequences running on it
    running: dict[int, int]  # tenant id -> requests running
    waiting: dict[int, int]  # tenant id -> requests queued (VTC), every band
    fcfs_waiting: int  # requests queued under the FCFS policy
    by_band: dict[str, int]  # priority class -> requests queued in its band
    lent: int = 0  # sequences running on room lent to batch lines (``borrow``)
    lend_percent: int = 0  # the share of its capacity the pool lends (0: none)
    reclaimed: int = 0  # lent requests taken back for online ones, ever

    @property
    def queued(self) -> int:
        return sum(self.waiting.values()) + self.fcfs_waiting


def queue_state(pool: str) -> QueueState:
    """What admission holds for ``pool`` in Redis (RedisError if it is unreachable)."""
    from controlplane.redis import redis_sync

    client, base = redis_sync(), pool_prefix(pool)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(base + "rload")
    pipe.hgetall(base + "active")
    pipe.get(base + "lent_seqs")
    pipe.get(base + "lend")
    pipe.hget(base + "lending", "reclaimed")
    for band in range(BANDS):
        pipe.zrange(f"{base}backlog:{band}", 0, -1)
        pipe.llen(f"{base}fcfs:{band}")
    rload, active, lent, lend, reclaimed, *queues = pipe.execute()
    backlogs, fcfs = queues[0::2], [int(n) for n in queues[1::2]]
    pipe = client.pipeline(transaction=False)
    lists = [(band, t) for band, tenants in enumerate(backlogs) for t in tenants]
    for band, t in lists:
        pipe.llen(f"{base}q:{band}:{t.decode()}")
    waiting: Counter[int] = Counter()
    by_band = dict.fromkeys(PRIORITY_CLASSES, 0)
    for (band, t), n in zip(lists, pipe.execute() if lists else [], strict=True):
        waiting[int(t)] += n
        by_band[PRIORITY_CLASSES[band]] += n
    for band, n in enumerate(fcfs):
        by_band[PRIORITY_CLASSES[band]] += n
    return QueueState(
        in_flight={r.decode(): int(n) for r, n in rload.items()},
        running={int(t): int(n) for t, n in active.items() if int(n) > 0},
        waiting={t: n for t, n in waiting.items() if n},
        fcfs_waiting=sum(fcfs),
        by_band=by_band,
        lent=int(lent or 0),
        lend_percent=int(lend or 0),
        reclaimed=int(reclaimed or 0),
    )


def adapter_in_use(pool: str, *, tenant_id: int, engine_name: str) -> bool:
    """Whether a request for the adapter is admitted, or waiting for admission, in ``pool``
    (waiting ones are in their tenant's queue of a band, or the band's one queue under fcfs)."""
    from controlplane.redis import redis_sync

    client, prefix = redis_sync(), pool_prefix(pool)
    rids = cast(list[bytes], client.zrange(prefix + "inflight", 0, -1))
    for band in range(BANDS):
        rids += cast(list[bytes], client.lrange(f"{prefix}q:{band}:{tenant_id}", 0, -1))
        rids += cast(list[bytes], client.lrange(f"{prefix}fcfs:{band}", 0, -1))
    pipe = client.pipeline(transaction=False)
    for rid in rids:
        pipe.hget(prefix + "req:" + rid.decode(), "adapter")
    return engine_name.encode() in pipe.execute()
