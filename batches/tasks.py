"""Thin tasks. Batch work (validation, runs, files) is on the ``batch`` queue, its own worker:
it never delays probes, metering or rollups. A message only wakes a worker: what to do is
read from Postgres, so a message delivered twice, or lost with its worker, loses and doubles
nothing (the sweeper, on the default queue, wakes work nobody is doing). A validation or run
goes to the tenant whose turn it is, whichever batch's message woke the worker
(``batches.turns``): a message delivered twice gives someone one more turn."""

from __future__ import annotations

import logging
from typing import Any

from celery import current_app, shared_task
from django.dispatch import receiver

from batches.files import files_expired_delete
from batches.gauges import batch_gauges_store
from batches.models import Batch
from batches.selectors import batches_stuck
from batches.services import batch_finalize, batch_finish_if_done, batches_expire, batches_purge
from batches.signals import batch_files_waiting, batch_work_waiting
from batches.turns import run_turn, validation_turn

BATCH_QUEUE = "batch"  # the batch work's queue (CELERY_TASK_ROUTES)

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def batch_validate_task(batch_id: str) -> None:
    """``batch_id`` asked for a validation; the turn goes to the tenant whose turn it is
    (``batches.turns``)."""
    validation_turn()


@shared_task(ignore_result=True)
def batch_run_task(batch_id: str) -> None:
    """``batch_id`` asked for a run; the turn goes to the tenant whose turn it is, and a run
    that leaves lines asks for another. A batch being cancelled that asked is settled first
    when nothing of it is left to run (that is nobody's turn: nothing of it runs; a batch
    cancelled before its validation ended is no run's either)."""
    if Batch.objects.filter(pk=batch_id, status=Batch.Status.CANCELLING).exists():
        batch_finish_if_done(batch_id=batch_id)
    ran, outcome = run_turn()
    if ran is not None and outcome == "more":
        batch_run_task.apply_async((ran,), countdown=1)


@shared_task(ignore_result=True)
def batch_finalize_task(batch_id: str) -> None:
    batch_finalize(batch_id=batch_id)


@shared_task(ignore_result=True)
def batches_sweep_task() -> None:
    """Every few seconds: expire what is past its window, and wake a worker for every batch
    with work nobody is doing (a worker that died, a message that was lost); and count what
    /metrics shows of the batches, whatever happened to the rest."""
    try:
        _sweep()
    finally:
        batch_gauges_store()  # so that a scrape reads no database


def _sweep() -> None:
    batches_expire()
    waiting: list[str] = []  # running batches with work nobody is doing
    for batch_id in batches_stuck():
        batch = Batch.objects.filter(pk=batch_id).only("status", "ending_at").first()
        if batch is None:
            continue
        if batch.ending_at is not None:
            batch_finalize_task.delay(batch_id)
        elif batch.status == Batch.Status.VALIDATING:
            batch_validate_task.delay(batch_id)
        elif batch.status == Batch.Status.CANCELLING:  # its message settles it
            batch_run_task.delay(batch_id)
        else:
            waiting.append(batch_id)
    # A run message is a turn for whoever's turn it is: one queued per batch waiting is
    # enough (waking each one every sweep would grow the queue without end under a backlog
    # of batches waiting their turn).
    if waiting:  # (asking the broker costs a connection of its own: only when it matters)
        for batch_id in waiting[: max(0, len(waiting) - _queued(BATCH_QUEUE))]:
            batch_run_task.delay(batch_id)
    files_expired_delete()
    batches_purge()


def _queued(queue: str) -> int:
    """The messages waiting in one of the broker's queues (0 when it cannot say)."""
    try:
        with current_app.connection_for_read() as connection:
            channel: Any = connection.default_channel  # kombu's typing lacks queue_declare
            declared = channel.queue_declare(queue=queue, passive=True)
            return int(declared.message_count)
    except Exception:  # no such queue yet, or the broker is away: wake every batch
        return 0


# What the services ask for once their change is committed (``batches.signals``). If the
# broker cannot take a message now, the sweeper will (the change is committed either way).
@receiver(batch_work_waiting)
def _work_waiting(sender: Any, *, batch_id: str, validate: bool, **_: Any) -> None:
    try:
        (batch_validate_task if validate else batch_run_task).delay(batch_id)
    except Exception:
        log.warning("could not queue work for %s: the sweeper will", batch_id, exc_info=True)


@receiver(batch_files_waiting)
def _files_waiting(sender: Any, *, batch_id: str, **_: Any) -> None:
    try:
        batch_finalize_task.delay(batch_id)
    except Exception:
        log.warning("could not queue the files of %s: the sweeper will", batch_id, exc_info=True)
