"""Thin tasks. Batch work (validation, runs, files) is on the ``batch`` queue, its own worker:
it never delays probes, metering or rollups. A message only wakes a worker: what to do is
read from Postgres, so a message delivered twice, or lost with its worker, changes nothing
(the sweeper, on the default queue, wakes work nobody is doing). A validation or run goes to
the tenant whose turn it is, whichever batch's message woke the worker (``batches.turns``)."""

from __future__ import annotations

from celery import shared_task

from batches.files import files_expired_delete
from batches.gauges import batch_gauges_store
from batches.models import Batch
from batches.services import (
    batch_finalize,
    batches_expire,
    batches_purge,
    batches_stuck,
)
from batches.turns import run_turn, validation_turn


@shared_task(ignore_result=True)
def batch_validate_task(batch_id: str) -> None:
    """``batch_id`` asked for a validation; the turn goes to the tenant whose turn it is
    (``batches.turns``)."""
    validation_turn()


@shared_task(ignore_result=True)
def batch_run_task(batch_id: str) -> None:
    """``batch_id`` asked for a run; the turn goes to the tenant whose turn it is, and a run
    that leaves lines asks for another."""
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
    for batch_id in batches_stuck():
        batch = Batch.objects.filter(pk=batch_id).only("status", "ending_at").first()
        if batch is None:
            continue
        if batch.ending_at is not None:
            batch_finalize_task.delay(batch_id)
        elif batch.status == Batch.Status.VALIDATING:
            batch_validate_task.delay(batch_id)
        else:  # running, or cancelled while a validator that died held it
            batch_run_task.delay(batch_id)
    files_expired_delete()
    batches_purge()
