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
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import msgspec
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q, TextField
from django.db.models.functions import Cast
from django.utils import timezone
from redis.exceptions import RedisError

from batches.models import Batch, Line
from batches.wire import ENDPOINTS, error_body
from billing.pricing import PriceBook
from billing.services import usage_records_insert
from contract import UsageRecord
from controlplane.redis import redis_sync
from inference.catalog import catalog_read
from inference.gateway.auth import KeyInfo, key_info_from_db
from inference.gateway.db import run_db
from inference.gateway.errors import LENT_RECLAIMED, invalid_api_key
from inference.gateway.headless import run_whole
from inference.gateway.watch import watches_end

log = logging.getLogger(__name__)

# Lines answered by outcome (done, failed), counted by the workers for the gateway's /metrics.
BATCH_LINES_KEY = "ip:metrics:batch_lines"

RETRY_AFTER_SECONDS = 2.0  # a line that met a passing failure waits this long, then more
LEND_PAUSE_AFTER_FAILURE = 10.0  # after a lent line failed on its replica (the probe's period)
LEND_LOSSES_MAX = 3  # a line that lost its lent room this often in a run asks no more
# With a lending pool, at most this many of a run's lines wait for admission at a time (each
# asks the lending pool for room while it waits).
LEND_WAITING = 8
PERMANENT = frozenset(range(400, 500)) - {408, 409, 429}
CANCELLED = error_body("batch_cancelled")


@dataclass(frozen=True, slots=True)
class Claimed:
    pk: int
    body: bytes  # the request, as JSON: parsed only when it runs
    attempts: int
    failures: int = 0  # passing failures after it reached an engine, before this claim
    size: int = 0  # its bytes in the input file (what it counts toward the in-flight bound)


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


def _claim(batch_id: str, token: str, n: int, room: int | None = None) -> list[Claimed]:
    """Up to ``n`` lines ready to run, their sizes within ``room`` bytes (the first one
    whatever its size), claimed for ``token``; their bodies as JSON text (a body parsed
    grows up to ~25 times: it is parsed only when it runs)."""
    now = timezone.now()
    lease = now + timedelta(seconds=settings.INFERPLANE_BATCH_LEASE_SECONDS)
    ready = Q(state=Line.State.PENDING) & (Q(lease_until__isnull=True) | Q(lease_until__lt=now))
    abandoned = Q(state=Line.State.RUNNING, lease_until__lt=now)
    with transaction.atomic():
        found = list(
            Line.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(
                Q(batch_id=batch_id, batch__status=Batch.Status.IN_PROGRESS) & (ready | abandoned)
            )
            .order_by("number")
            .values_list("pk", "size")[:n]
        )
        ids: list[int] = []
        taken = 0
        for pk, size in found:
            if ids and room is not None and taken + size > room:
                break
            ids.append(pk)
            taken += size
        if not ids:
            return []
        Line.objects.filter(pk__in=ids).update(
            state=Line.State.RUNNING, owner=token, lease_until=lease, attempts=F("attempts") + 1
        )
        rows = Line.objects.filter(pk__in=ids).values_list(
            "pk", Cast("body", TextField()), "attempts", "failures", "size"
        )
        return [
            Claimed(pk, body.encode(), attempts, failures, size)
            for pk, body, attempts, failures, size in rows
        ]


def _renew(token: str, pks: list[int]) -> None:
    lease = timezone.now() + timedelta(seconds=settings.INFERPLANE_BATCH_LEASE_SECONDS)
    Line.objects.filter(pk__in=pks, owner=token, state=Line.State.RUNNING).update(lease_until=lease)


@dataclass(frozen=True, slots=True)
class Answer:
    line: Claimed
    status: int
    body: dict[str, Any]
    record: UsageRecord | None
    begun: bool = False  # it got past admission: a replica worked on it
    # The records of its moderation's guard model (``<request id>:guard``): billed with it.
    extra: tuple[UsageRecord, ...] = ()


def _exhausted(answer: Answer) -> Answer:
    """The answer a line gets once it failed on the engines as often as it may: its last
    error, said to be the last (the batch goes on; the error file has it)."""
    error = answer.body.get("error") if isinstance(answer.body, dict) else None
    last = error.get("message") if isinstance(error, dict) else None
    tries = answer.line.failures + 1
    body = {
        "error": {
            "message": f"The request reached an engine {tries} times and failed each time "
            f"(last: HTTP {answer.status}{': ' + last if last else ''}); it is not tried again.",
            "type": "server_error",
            "param": None,
            "code": "line_attempts_exhausted",
        }
    }
    return Answer(answer.line, answer.status or 500, body, None, answer.begun)


def _store(
    line: Claimed, token: str, status: int, body: dict[str, Any], record: UsageRecord | None
) -> bool:
    """One line's answer (see ``_store_many``)."""
    return _store_many(token, [Answer(line, status, body, record)]) == 1


def _store_many(token: str, answers: list[Answer]) -> int:
    """Lines' answers, each with its usage, for the lines this run still owns (one it lost —
    reclaimed after our lease ran out, or expired with its batch — is neither stored nor
    billed): the lines' results and the ledger's records in one transaction. Passing
    failures put their line back. Returns how many answers were kept."""
    kept = 0
    final: list[Answer] = []
    most = settings.INFERPLANE_BATCH_LINE_MAX_ATTEMPTS
    for answer in answers:
        if answer.status == 200 or answer.status in PERMANENT:
            final.append(answer)
            continue
        mine = Line.objects.filter(pk=answer.line.pk, owner=token, state=Line.State.RUNNING)
        if _error_code(answer.body) == LENT_RECLAIMED:
            # Its lent room was taken back: pending again at once, neither a failure nor an
            # attempt (a line preempted over and over still completes, without a longer pause).
            kept += mine.update(
                state=Line.State.PENDING, owner="", lease_until=None, attempts=F("attempts") - 1
            )
            continue
        if answer.begun and answer.line.failures + 1 >= most:
            final.append(_exhausted(answer))  # a line that fails every engine: not forever
            continue
        # The batch was cancelled meanwhile: the line will not run again.
        if mine.filter(batch__status=Batch.Status.CANCELLING).update(
            state=Line.State.CANCELLED, owner="", lease_until=None, response=CANCELLED
        ):
            kept += 1
            continue
        pause = RETRY_AFTER_SECONDS * min(answer.line.attempts, 30)
        back = mine.update(
            state=Line.State.PENDING,
            owner="",
            lease_until=timezone.now() + timedelta(seconds=pause),
            failures=F("failures") + int(answer.begun),
        )
        if back and answer.begun:  # the operator's line per failure on an engine (not kept)
            log.warning(
                "batch line %s failed on an engine (%s %s); pending again in %.0f s",
                answer.line.pk,
                answer.status,
                _error_text(answer.body),
                pause,
            )
        kept += back
    if not final:
        return kept
    outcomes: Counter[str] = Counter()
    # Priced here, as the ledger would price them (the price in force when each started), so
    # each line keeps what it cost: a batch's cost so far is a sum over its lines.
    book = PriceBook.for_models({r.model for a in final for r in _records(a)})
    with transaction.atomic():
        billed = []
        for answer in final:
            records = [_priced(r, book) for r in _records(answer)]
            record = records[0] if records else None
            stored = Line.objects.filter(
                pk=answer.line.pk, owner=token, state=Line.State.RUNNING
            ).update(
                state=Line.State.DONE if answer.status == 200 else Line.State.FAILED,
                owner="",
                lease_until=None,
                result_id="batch_req_" + secrets.token_hex(12),
                status_code=answer.status,
                request_id=record.request_id if record is not None else "",
                response=answer.body,
                prompt_tokens=record.prompt_tokens if record else 0,
                completion_tokens=record.completion_tokens if record else 0,
                cached_tokens=record.cached_tokens if record else 0,
                cost_micros=sum(r.cost_micros or 0 for r in records),
            )
            kept += stored
            if stored:
                outcomes["done" if answer.status == 200 else "failed"] += 1
                billed.extend(records)
        if billed:
            usage_records_insert(billed)
    _count_processed(outcomes)
    return kept


def _error_code(body: dict[str, Any]) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("code") or "") if isinstance(error, dict) else ""


def _error_text(body: dict[str, Any]) -> str:
    """An error's code and the start of its message (ours or the engine's: no prompt text)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return ""
    return (
        f"{error.get('code') or error.get('type') or ''}: {str(error.get('message') or '')[:200]}"
    )


def _records(answer: Answer) -> list[UsageRecord]:
    """What an answer bills: its record, then its guard's (none without a record)."""
    return [answer.record, *answer.extra] if answer.record is not None else []


def _priced(record: UsageRecord, book: PriceBook) -> UsageRecord:
    if record.cost_micros is not None:
        return record
    return msgspec.structs.replace(record, cost_micros=book.cost_micros(record))


def _count_processed(outcomes: Counter[str]) -> None:
    """Lines answered, for the gateway's /metrics (``controlplane.metrics``): workers are not
    scraped, so they count in Redis. A count lost to a Redis outage is only a metric."""
    try:
        pipe = redis_sync().pipeline(transaction=False)
        for outcome, n in outcomes.items():
            pipe.hincrby(BATCH_LINES_KEY, outcome, n)
        pipe.execute()
    except RedisError:
        log.warning("batch line counts for the metrics lost (Redis unavailable)")


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
            lending.ended(line.pk, status=status, code=_error_code(body))
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
            claimed = await run_db(_claim, plan.batch_id, token, free, left)
            exhausted = not claimed
            for line in claimed:
                running[asyncio.ensure_future(_run_line(plan, line, begun, lending))] = line.pk
                sizes[line.pk] = line.size
        if answered and (
            not running
            or len(answered) >= FLUSH_EVERY
            or time.monotonic() - flushed > FLUSH_SECONDS
        ):
            await run_db(_store_many, token, answered)
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
                reopen = reopen or _error_code(answered[-1].body) == LENT_RECLAIMED
        if time.monotonic() - renewed > renew_every and (running or answered):
            await run_db(_renew, token, [*running.values(), *(a.line.pk for a in answered)])
            renewed = time.monotonic()
