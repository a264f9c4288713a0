"""A run's lines in Postgres: claimed with a lease and an owner token (``claim``, ``renew``),
their answers stored once by their owner, with their usage records, in one transaction
(``store_many``); a passing failure puts its line back, after a pause."""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q, TextField
from django.db.models.functions import Cast
from django.utils import timezone
from redis.exceptions import RedisError

from batches.models import Batch, Line
from batches.wire import error_body
from billing.pricing import PriceBook
from billing.services import usage_records_insert
from contract import UsageRecord
from controlplane.redis import redis_sync
from inference.gateway.errors import LENT_RECLAIMED

log = logging.getLogger(__name__)

# Lines answered by outcome (done, failed), counted by the workers for the gateway's /metrics.
BATCH_LINES_KEY = "ip:metrics:batch_lines"

RETRY_AFTER_SECONDS = 2.0  # a line that met a passing failure waits this long, then more
PERMANENT = frozenset(range(400, 500)) - {408, 409, 429}
CANCELLED = error_body("batch_cancelled")


@dataclass(frozen=True, slots=True)
class Claimed:
    pk: int
    body: bytes  # the request, as JSON: parsed only when it runs
    attempts: int
    failures: int = 0  # passing failures after it reached an engine, before this claim
    size: int = 0  # its bytes in the input file (what it counts toward the in-flight bound)


def claim(batch_id: str, token: str, n: int, room: int | None = None) -> list[Claimed]:
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


def renew(token: str, pks: list[int]) -> None:
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


def store(
    line: Claimed, token: str, status: int, body: dict[str, Any], record: UsageRecord | None
) -> bool:
    """One line's answer (see ``store_many``)."""
    return store_many(token, [Answer(line, status, body, record)]) == 1


def store_many(token: str, answers: list[Answer]) -> int:
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
        if error_code(answer.body) == LENT_RECLAIMED:
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


def error_code(body: dict[str, Any]) -> str:
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
