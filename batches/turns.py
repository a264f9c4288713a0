"""Whose turn it is: batch work taken fairly between tenants.

Validations and runs are Celery tasks on the ``batch`` queue, one message for each batch that
asked for work (a new batch, a validated one, a run that left lines, the sweeper's wake-up).
A message does not decide which batch the worker takes: when the task starts, the turn goes
to the tenant whose latest turn of that kind is the oldest (one with none in the last hour
first, one being worked on now last), to that tenant's oldest batch with work, which the
turn holds (one turn a batch at a time; a batch another worker holds is passed over). A
tenant with fifty batches queued thus gets a turn as often as one with a single batch,
whatever order their messages came in; every message still gives someone a turn, and a run
that leaves lines asks for another.

A tenant's latest turn is read from its batches' holds (``validating_until``: a validation's
lease; ``running_until``: a run's hold), each set to the turn's end when it ends.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import F, OuterRef, QuerySet, Subquery
from django.utils import timezone

from batches.models import Batch
from batches.runner import batch_run, run_hold_until
from batches.selectors import batches_runnable, free
from batches.validation import batch_validate, validation_take

# Turns older than this count as none (a tenant back after a quiet hour goes first).
MEMORY = timedelta(hours=1)
TRIES = 8  # batches tried in one turn when other workers take the fairest meanwhile


def _fairest(candidates: QuerySet[Batch], held: str, now: datetime) -> str | None:
    """The candidate whose turn it is: its tenant's latest ``held`` oldest (none first),
    then its oldest batch."""
    latest = (
        Batch.objects.filter(tenant_id=OuterRef("tenant_id"), **{f"{held}__gte": now - MEMORY})
        .order_by(F(held).desc())
        .values(held)[:1]
    )
    found: str | None = (
        candidates.annotate(turn=Subquery(latest))
        .order_by(F("turn").asc(nulls_first=True), "created_at", "pk")
        .values_list("pk", flat=True)
        .first()
    )
    return found


def validation_turn() -> str | None:
    """Validate the batch whose tenant's turn it is; its id, or None when no batch waits."""
    for _ in range(TRIES):
        now = timezone.now()
        waiting = Batch.objects.filter(
            free("validating_until", now), status=Batch.Status.VALIDATING
        )
        batch_id = _fairest(waiting, "validating_until", now)
        if batch_id is None:
            return None
        lease = validation_take(batch_id)
        if lease is not None:  # else another worker took it first: whose turn is it now?
            try:
                batch_validate(batch_id=batch_id, lease=lease)
            finally:  # the turn's end is its tenant's latest validation
                Batch.objects.filter(pk=batch_id, validating_until=lease).update(
                    validating_until=timezone.now()
                )
            return batch_id
    return None


def run_turn(*, seconds: float | None = None) -> tuple[str | None, str]:
    """Run the batch whose tenant's turn it is, for up to ``seconds``: (its id, what
    ``batch_run`` said), or (None, "idle") when no batch has work nobody is doing."""
    for _ in range(TRIES):
        now = timezone.now()
        batch_id = _fairest(batches_runnable(now), "running_until", now)
        if batch_id is None:
            return None, "idle"
        _, until = run_hold_until(seconds)
        taken = Batch.objects.filter(free("running_until", now), pk=batch_id)
        if taken.update(running_until=until):
            return batch_id, batch_run(batch_id=batch_id, seconds=seconds, held_until=until)
    return None, "idle"
