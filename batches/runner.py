"""Running a batch's lines: claim, run through the gateway's request path, store once.

A worker keeps up to ``INFERPLANE_BATCH_CONCURRENCY`` lines in flight on one event loop of
its own (kept for the process's life, so the engine and Redis clients are reused), claiming
more as lines finish. A claim marks lines ``running`` with this run's owner token and a
lease; a line whose lease ran out (its worker died) is claimed again by anyone. A result is
stored only by the line's owner, with its usage record, in one transaction: a line is
answered once and billed once, and a line never stored was never billed.

What a line's answer means for it:
- 200 → ``done`` (the output file);
- an error the request itself caused (4xx but 408, 409, 429) → ``failed`` (the error file);
- anything passing (429 rate limits, 503 queue timeout or no capacity, 5xx, a replica that
  died) → back to ``pending``, not before a pause: a vanished spot pool waits for capacity
  until the window expires instead of failing lines.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import orjson
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from batches.models import Batch, Line
from batches.services import ENDPOINTS
from billing.services import usage_records_insert
from contract import UsageRecord
from inference.api.auth import KeyInfo, key_info_from_db
from inference.api.db import run_db
from inference.api.errors import invalid_api_key
from inference.api.lifecycle import run_whole
from inference.catalog import catalog_read

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 2.0  # a line that met a passing failure waits this long, then more
PERMANENT = frozenset(range(400, 500)) - {408, 409, 429}


@dataclass(frozen=True, slots=True)
class Claimed:
    pk: int
    body: dict[str, Any]
    attempts: int


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run of a batch needs, read once."""

    batch_id: str
    key: KeyInfo | None
    pool: str
    endpoint: str


_loop: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """This process's loop for batch work (a Celery worker process runs one task at a time)."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def batch_run(*, batch_id: str, seconds: float | None = None) -> str:
    """Run the batch's lines for up to ``seconds``; then "finished", "more" (lines left:
    the caller queues another run) or "idle" (nothing to run here now)."""
    plan = _plan(batch_id)
    if plan is None:
        return "idle"
    budget = seconds if seconds is not None else settings.INFERPLANE_BATCH_RUN_SECONDS
    token = uuid.uuid4().hex
    _event_loop().run_until_complete(_drive(plan, token, time.monotonic() + budget))
    from batches.services import batch_finish_if_done

    if batch_finish_if_done(batch_id=batch_id):
        return "finished"
    left = Line.objects.filter(batch_id=batch_id, state=Line.State.PENDING).exists()
    return "more" if left else "idle"


def _plan(batch_id: str) -> Plan | None:
    batch = Batch.objects.select_related("api_key").filter(pk=batch_id).first()
    if batch is None or batch.status not in (Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING):
        return None
    found = catalog_read().callable(batch.model, batch.tenant_id, kind="batch")
    return Plan(
        batch_id=batch.pk,
        key=key_info_from_db(batch.api_key.prefix),
        pool=(found.pool if found is not None else None) or "",
        endpoint=ENDPOINTS[batch.endpoint],
    )


def _claim(batch_id: str, token: str, n: int) -> list[Claimed]:
    now = timezone.now()
    lease = now + timedelta(seconds=settings.INFERPLANE_BATCH_LEASE_SECONDS)
    ready = Q(state=Line.State.PENDING) & (Q(lease_until__isnull=True) | Q(lease_until__lt=now))
    abandoned = Q(state=Line.State.RUNNING, lease_until__lt=now)
    with transaction.atomic():
        ids = list(
            Line.objects.select_for_update(skip_locked=True)
            .filter(Q(batch_id=batch_id) & (ready | abandoned))
            .order_by("number")
            .values_list("pk", flat=True)[:n]
        )
        if not ids:
            return []
        Line.objects.filter(pk__in=ids).update(
            state=Line.State.RUNNING, owner=token, lease_until=lease, attempts=F("attempts") + 1
        )
        rows = Line.objects.filter(pk__in=ids).values_list("pk", "body", "attempts")
        return [Claimed(pk, body, attempts) for pk, body, attempts in rows]


def _renew(token: str, pks: list[int]) -> None:
    lease = timezone.now() + timedelta(seconds=settings.INFERPLANE_BATCH_LEASE_SECONDS)
    Line.objects.filter(pk__in=pks, owner=token, state=Line.State.RUNNING).update(lease_until=lease)


def _store(
    line: Claimed, token: str, status: int, body: dict[str, Any], record: UsageRecord | None
) -> bool:
    """The line's answer, with its usage, if this run still owns the line (False if not: it
    was reclaimed after our lease ran out, or the batch expired meanwhile)."""
    if status != 200 and status not in PERMANENT:
        pause = RETRY_AFTER_SECONDS * min(line.attempts, 30)
        back = Line.objects.filter(pk=line.pk, owner=token, state=Line.State.RUNNING).update(
            state=Line.State.PENDING,
            owner="",
            lease_until=timezone.now() + timedelta(seconds=pause),
        )
        return bool(back)
    usage = body.get("usage") if status == 200 else None
    with transaction.atomic():
        stored = Line.objects.filter(pk=line.pk, owner=token, state=Line.State.RUNNING).update(
            state=Line.State.DONE if status == 200 else Line.State.FAILED,
            owner="",
            lease_until=None,
            result_id="batch_req_" + secrets.token_hex(12),
            status_code=status,
            request_id=record.request_id if record is not None else "",
            response=body,
            prompt_tokens=record.prompt_tokens if record else (usage or {}).get("prompt_tokens", 0),
            completion_tokens=record.completion_tokens if record else 0,
            cached_tokens=record.cached_tokens if record else 0,
        )
        if stored and record is not None:
            usage_records_insert([record])
    return bool(stored)


async def _run_line(plan: Plan, line: Claimed, token: str) -> None:
    records: list[UsageRecord] = []
    if plan.key is None:
        status, body = 401, invalid_api_key("(revoked)").body()
    elif not plan.pool:
        status, body = 503, {"error": {"message": "no batch pool", "type": "server_error"}}
    else:
        status, body = await run_whole(
            key=plan.key,
            raw_body=orjson.dumps(line.body),
            endpoint=plan.endpoint,
            pool=plan.pool,
            mode="batch",
            ledger=records.append,
        )
    await run_db(_store, line, token, status, body, records[0] if records else None)


async def _drive(plan: Plan, token: str, deadline: float) -> None:
    """Keep lines in flight until none is left to claim, or the time is up."""
    width = settings.INFERPLANE_BATCH_CONCURRENCY
    if plan.key is not None and plan.key.limit("max_concurrency"):
        # More would only be refused (429) and come back later: stay inside the limit.
        width = min(width, plan.key.limit("max_concurrency"))
    running: dict[asyncio.Task[None], int] = {}
    renew_every = settings.INFERPLANE_BATCH_LEASE_SECONDS / 3
    renewed = time.monotonic()
    exhausted = False
    while True:
        if not exhausted and time.monotonic() < deadline and len(running) < width:
            claimed = await run_db(_claim, plan.batch_id, token, width - len(running))
            exhausted = not claimed
            for line in claimed:
                running[asyncio.ensure_future(_run_line(plan, line, token))] = line.pk
        if not running:
            return
        done, _ = await asyncio.wait(running, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            running.pop(task)
            if task.exception() is not None:  # its line stays claimed: the lease brings it back
                log.error(
                    "batch %s: a line failed to run", plan.batch_id, exc_info=task.exception()
                )
        if time.monotonic() - renewed > renew_every and running:
            await run_db(_renew, token, list(running.values()))
            renewed = time.monotonic()
