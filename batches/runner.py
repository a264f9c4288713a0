"""Running a batch's lines: claim, run through the gateway's request path, store once.

A worker keeps up to ``INFERPLANE_BATCH_CONCURRENCY`` lines in flight on one event loop of
its own (kept for the process's life, so the engine and Redis clients are reused), claiming
more as lines finish. A claim marks lines ``running`` with this run's owner token and a
lease; a line whose lease ran out (its worker died) is claimed again by anyone. A result is
stored only by the line's owner, with its usage record, in one transaction: a line is
answered once and billed once, and a line never stored was never billed.

What a line's answer means for it:
- 200 → ``done`` (the output file);
- an error the request itself caused (4xx but 408, 409, 429; an answer past
  ``INFERPLANE_BATCH_MAX_ANSWER_BYTES``) → ``failed`` (the error file);
- anything passing (429 rate limits, 503 queue timeout or no capacity, 5xx, an answer slower
  than the whole-answer bound, a replica that died) → back to ``pending``, not before a
  pause: a vanished spot pool waits for capacity until the window expires instead of failing
  lines. A line that reached an engine and failed there ``INFERPLANE_BATCH_LINE_MAX_ATTEMPTS``
  times fails (``line_attempts_exhausted``): a line that breaks every replica it meets, or
  that no replica can finish in time, does not hold its batch open until it expires.

A model's online pool that lends idle room (``Pool.lend_percent``) takes lines too: each line
asks it first (``prepare``'s ``lend``), at once, and waits in the batch's spot pool's queue
when it has none, leaving the queue for lent room that comes first; a line whose lent room an
online request took back (``lent_capacity_reclaimed``) goes back to pending at once, not
counted as a failure (it is billed once, when it is answered).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from batches.lines import Answer, Claimed, claim, error_code, renew, store_many
from batches.models import Batch, Line
from batches.wire import ENDPOINTS
from contract import UsageRecord
from inference.catalog import catalog_read
from inference.gateway.auth import KeyInfo, key_info_from_db
from inference.gateway.db import run_db
from inference.gateway.errors import LENT_RECLAIMED, invalid_api_key
from inference.gateway.headless import run_whole
from inference.gateway.watch import watches_end

log = logging.getLogger(__name__)

LEND_PAUSE_AFTER_FAILURE = 10.0  # after a lent line failed on its replica (the probe's period)
LEND_LOSSES_MAX = 3  # a line that lost its lent room this often in a run asks no more
# With a lending pool, at most this many of a run's lines wait for admission at a time (each
# asks the lending pool for room while it waits).
LEND_WAITING = 8


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run of a batch needs, read once."""

    batch_id: str
    key: KeyInfo | None
    pool: str
    endpoint: str
    lend: str = ""  # the model's online pool, when it lends idle room to batch lines


@dataclass(slots=True)
class Lending:
    """Whether a run's lines ask the online pool for room now."""

    pool: str
    failed_until: float = 0.0  # no asking before this (a lending replica failed a line)
    # Set when a line is admitted: with few lines waiting at a time, the run claims the next
    # at once, not at its next look.
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    freed: int = 0  # lent lines ended since the run last claimed: room to claim lines for
    lost: Counter[int] = dataclasses.field(default_factory=Counter)  # rooms lost, by line

    def ask(self, pk: int) -> str | None:
        """The pool a line asks (at once, then while it waits in its own pool's queue):
        none for ``LEND_PAUSE_AFTER_FAILURE`` after a lending replica failed a line (dead,
        stuck: not before the health probe can tell), nor for a line that lost its lent room
        ``LEND_LOSSES_MAX`` times (it runs on the spot pool: a long line beside an online
        load that comes and goes would lose it forever)."""
        if not self.pool or not self.open():
            return None
        return self.pool if self.lost[pk] < LEND_LOSSES_MAX else None

    def open(self) -> bool:
        """Whether a line already waiting in its own pool's queue may still ask."""
        return time.monotonic() >= self.failed_until

    def admitted(self) -> None:
        if self.pool:
            self.wake.set()

    def ended(self, pk: int, *, status: int, code: str) -> None:
        """A lent line ended: its room may be lent again at once (``freed``), unless an
        online request took it or the lending replica failed the line."""
        if code == LENT_RECLAIMED:
            self.lost[pk] += 1
        elif status >= 500:
            self.failed_until = time.monotonic() + LEND_PAUSE_AFTER_FAILURE
        else:
            self.freed += 1


_loop: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """This process's loop for batch work (a Celery worker process runs one task at a time)."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def run_hold_until(seconds: float | None = None) -> tuple[float, datetime]:
    """A run's time (``seconds``, else ``INFERPLANE_BATCH_RUN_SECONDS``) and until when it
    holds its batch (the sweeper and other turns leave it alone until then)."""
    budget = seconds if seconds is not None else settings.INFERPLANE_BATCH_RUN_SECONDS
    grace = settings.INFERPLANE_BATCH_RUN_GRACE_SECONDS
    return budget, timezone.now() + timedelta(seconds=budget + grace)


def batch_run(
    *, batch_id: str, seconds: float | None = None, held_until: datetime | None = None
) -> str:
    """Run the batch's lines for up to ``seconds``; then "finished", "more" (lines left:
    the caller queues another run) or "idle" (nothing to run here now). ``held_until``:
    the hold the caller took on the batch already (``batches.turns``), else this run takes
    one. Either way the hold is given back when the run ends: its end is the time of the
    tenant's latest turn."""
    budget, until = run_hold_until(seconds)
    until = held_until or until
    try:
        plan = _plan(batch_id)
        if plan is None:
            return "idle"
        if held_until is None:
            Batch.objects.filter(pk=batch_id).update(running_until=until)
        token = uuid.uuid4().hex
        loop = _event_loop()
        try:
            loop.run_until_complete(_drive(plan, token, time.monotonic() + budget))
        finally:
            # The loop stops until the next run: its catalog and policy subscriptions end
            # with this one (they would read nothing meanwhile); the next looks first.
            loop.run_until_complete(watches_end())
    finally:
        Batch.objects.filter(pk=batch_id, running_until=until).update(running_until=timezone.now())
    from batches.services import batch_finish_if_done

    if batch_finish_if_done(batch_id=batch_id):
        return "finished"
    left = Line.objects.filter(batch_id=batch_id, state=Line.State.PENDING).exists()
    return "more" if left else "idle"


def _plan(batch_id: str) -> Plan | None:
    batch = Batch.objects.select_related("api_key").filter(pk=batch_id).first()
    if batch is None or batch.status not in (Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING):
        return None
    catalog = catalog_read(tenant_id=batch.tenant_id)
    found = catalog.callable(batch.model, batch.tenant_id, kind="batch")
    lend = catalog.lender(batch.model, batch.tenant_id)
    return Plan(
        batch_id=batch.pk,
        key=key_info_from_db(batch.api_key.prefix),
        # Without a spot pool, lines run only on the room the online pool lends.
        pool=(found.pool if found is not None else None) or lend or "",
        endpoint=ENDPOINTS[batch.endpoint],
        lend=lend or "",
    )


async def _run_line(plan: Plan, line: Claimed, begun: set[int], lending: Lending) -> Answer:
    # Each attempt begins before admission: a line this run claims again (its lent room was
    # taken back) and that then waits too long for a slot did not fail on an engine (it
    # counted as a failure, one of the line's last attempts, when its first try's admission
    # was remembered).
    begun.discard(line.pk)
    records: list[UsageRecord] = []
    # Without a spot pool a line runs only on lent room: it always asks (and comes back later).
    asked = plan.lend if plan.lend and plan.pool == plan.lend else lending.ask(line.pk)
    lent = False

    def admitted(pool: str) -> None:
        nonlocal lent
        begun.add(line.pk)
        lending.admitted()
        lent = asked is not None and pool == asked

    if (
        plan.key is not None
        and plan.key.expires_at is not None
        and plan.key.expires_at <= time.time()
    ):
        status, body = 401, invalid_api_key("(expired)").body()
    elif plan.key is None:
        status, body = 401, invalid_api_key("(revoked)").body()
    elif not plan.pool:
        status, body = 503, {"error": {"message": "no batch pool", "type": "server_error"}}
    else:
        status, body = await run_whole(
            key=plan.key,
            raw_body=line.body,
            endpoint=plan.endpoint,
            pool=plan.pool,
            mode="batch",
            ledger=records.append,
            admitted=admitted,
            lend=asked,
            lend_open=lending.open,
        )
        if lent:
            lending.ended(line.pk, status=status, code=error_code(body))
    main = records[0] if records else None
    # The body is not kept with the answer: answers wait to be stored in groups.
    ran = dataclasses.replace(line, body=b"")
    return Answer(ran, status, body, main, line.pk in begun, tuple(records[1:]))


def _batch_state(batch_id: str) -> tuple[str, bool]:
    """(status, whether its ending began)."""
    row = Batch.objects.filter(pk=batch_id).values_list("status", "ending_at").first()
    return ("", True) if row is None else (row[0], row[1] is not None)


FLUSH_EVERY = 32  # answers stored per transaction at most
FLUSH_SECONDS = 0.5  # and none waits longer than this to be stored
CHECK_SECONDS = 1.0  # how often a run looks whether its batch was cancelled or expired


async def _drive(plan: Plan, token: str, deadline: float) -> None:
    """Keep lines in flight until none is left to claim, or the time is up; store answers
    in groups (one transaction, one ledger insert each)."""
    width = settings.INFERPLANE_BATCH_CONCURRENCY
    if plan.key is not None and plan.key.limit("max_concurrency"):
        # More would only be refused (429) and come back later: stay inside the limit.
        width = min(width, plan.key.limit("max_concurrency"))
    chunk = max(1, width // 8)
    room = settings.INFERPLANE_BATCH_INFLIGHT_BYTES
    lending = Lending(plan.lend)
    running: dict[asyncio.Task[Answer], int] = {}
    sizes: dict[int, int] = {}  # the bytes of each line running
    answered: list[Answer] = []
    begun: set[int] = set()  # lines past admission: on an engine, they finish
    renew_every = settings.INFERPLANE_BATCH_LEASE_SECONDS / 3
    renewed = flushed = looked = time.monotonic()
    exhausted = stopped = False
    reopen = False  # a line went back to pending that this run may claim again
    while True:
        if running and time.monotonic() - looked > CHECK_SECONDS:
            looked = time.monotonic()
            status, ending = await run_db(_batch_state, plan.batch_id)
            if ending or status != Batch.Status.IN_PROGRESS:
                # Cancelled: lines still waiting for a replica will not run (those on an
                # engine finish). Expired or finished: nothing of ours will be kept.
                exhausted = stopped = True
                for task, pk in running.items():
                    if ending or pk not in begun:
                        task.cancel()
        # Claim in chunks (an eighth of the width at least): one transaction per line
        # finished would cost more than the lines' own bookkeeping.
        lending.wake.clear()  # an admission from now on ends the wait below
        free, left = width - len(running), room - sum(sizes.values())
        wanted = free >= chunk
        if plan.lend:
            # Few lines wait in the spot pool's queue: each asks the online pool for room
            # every half second while it waits (``prepare``), a few asks are enough. Lines
            # admitted anywhere do not count: the spot pool stays full.
            # A lent line that ended left room there: a line claimed now takes it at once.
            waiting = sum(1 for pk in running.values() if pk not in begun)
            free = min(free, LEND_WAITING - waiting + lending.freed)
            lending.freed = 0
            wanted = free >= 1
        if not exhausted and time.monotonic() < deadline and (not running or (wanted and left > 0)):
            claimed = await run_db(claim, plan.batch_id, token, free, left)
            exhausted = not claimed
            for line in claimed:
                running[asyncio.ensure_future(_run_line(plan, line, begun, lending))] = line.pk
                sizes[line.pk] = line.size
        if answered and (
            not running
            or len(answered) >= FLUSH_EVERY
            or time.monotonic() - flushed > FLUSH_SECONDS
        ):
            await run_db(store_many, token, answered)
            answered, flushed = [], time.monotonic()
            if reopen and not stopped:  # lines lent room lost are pending again: ours to claim
                exhausted = reopen = False
        if not running:
            if exhausted or time.monotonic() >= deadline:
                return
            continue  # lines it lost lent room for are pending again: claimed next
        woken: asyncio.Future[Any] = asyncio.ensure_future(lending.wake.wait())
        await asyncio.wait(
            [*running, woken], timeout=FLUSH_SECONDS, return_when=asyncio.FIRST_COMPLETED
        )
        woken.cancel()
        for task in [task for task in running if task.done()]:
            pk = running.pop(task)
            sizes.pop(pk, None)
            begun.discard(pk)  # its answer says whether it began; a next attempt starts anew
            if task.cancelled():  # the batch stopped before the line began (see above)
                line = Claimed(pk, b"", 0)
                answered.append(Answer(line, 0, {}, None))
            elif task.exception() is not None:  # a bug of ours: the line goes back, paused
                log.error(
                    "batch %s: a line failed to run", plan.batch_id, exc_info=task.exception()
                )
                answered.append(Answer(Claimed(pk, b"", 1), 500, {}, None))  # failures unknown
            else:
                answered.append(task.result())
                reopen = reopen or error_code(answered[-1].body) == LENT_RECLAIMED
        if time.monotonic() - renewed > renew_every and (running or answered):
            await run_db(renew, token, [*running.values(), *(a.line.pk for a in answered)])
            renewed = time.monotonic()
