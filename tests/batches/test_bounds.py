"""Batch lines are bounded (docs/isolation.md): a line that fails on the engines fails for
good after ``INFERPLANE_BATCH_LINE_MAX_ATTEMPTS`` (waiting for capacity costs none), and an
expired batch's files get one writer (a second waits for the first's stamp to go stale).
Real Postgres and Redis, the runner's and the sweeper's own functions; the same through a
real worker and engine is in tests/batches/test_batch_faults.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import current_app
from django.db import transaction
from django.utils import timezone

from batches.lines import Answer, Claimed, claim, store_many
from batches.models import Batch, File, Line
from batches.runner import Lending, Plan, _run_line
from batches.selectors import batches_stuck
from batches.services import _begin_ending, batch_finalize, batches_expire
from batches.tasks import BATCH_QUEUE, _queued, _sweep, batch_run_task
from tenants.services import api_key_create
from tests.conftest import TenantPeople

pytestmark = pytest.mark.django_db(transaction=True)

BUSY = {"error": {"message": "No replica could serve the request.", "type": "server_error"}}
SLOW = {"error": {"message": "The engine did not finish the answer within 9 s.", "code": "timeout"}}


@pytest.fixture(autouse=True)
def _own_storage(settings: Any, tmp_path: Path) -> None:
    settings.MEDIA_ROOT = str(tmp_path)


def _batch(people: TenantPeople, lines: int = 1, **fields: Any) -> Batch:
    key = api_key_create(tenant=people.tenant, name="ci", created_by=None).api_key
    batch = Batch.objects.create(
        tenant=people.tenant,
        api_key=key,
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        **(
            {
                "status": Batch.Status.IN_PROGRESS,
                "in_progress_at": timezone.now(),
                "expires_at": timezone.now() + timedelta(hours=24),
            }
            | fields
        ),
    )
    for number in range(1, lines + 1):
        Line.objects.create(batch=batch, number=number, custom_id=f"r{number}", body={})
    return batch


def _attempt(batch: Batch, status: int, body: dict[str, Any], *, begun: bool) -> Line:
    """One claim of the batch's line and its answer, stored as the runner stores it."""
    Line.objects.filter(batch=batch).update(lease_until=None)  # no pause: claim it now
    [claimed] = claim(batch.pk, "run-1", 1)
    assert store_many("run-1", [Answer(claimed, status, body, None, begun)]) == 1
    return Line.objects.get(pk=claimed.pk)


def test_a_line_that_fails_on_the_engines_fails_after_the_attempts_and_waiting_costs_none(
    people: TenantPeople, settings: Any
) -> None:
    settings.INFERPLANE_BATCH_LINE_MAX_ATTEMPTS = 3
    batch = _batch(people)
    for _ in range(5):  # no capacity: it never reached an engine, it waits as long as it takes
        line = _attempt(batch, 503, BUSY, begun=False)
        assert (line.state, line.failures) == (Line.State.PENDING, 0)
    line = _attempt(batch, 504, SLOW, begun=True)
    line = _attempt(batch, 504, SLOW, begun=True)
    assert (line.state, line.failures) == (Line.State.PENDING, 2)
    line = _attempt(batch, 504, SLOW, begun=True)
    assert (line.state, line.status_code, line.failures) == (Line.State.FAILED, 504, 2)
    assert line.response is not None
    error = line.response["error"]
    assert error["code"] == "line_attempts_exhausted"
    assert "3 times" in error["message"] and "within 9 s" in error["message"]
    assert line.attempts == 8 and line.owner == ""


def test_an_expired_batch_has_one_writer_at_a_time(people: TenantPeople) -> None:
    batch = _batch(people, lines=2, expires_at=timezone.now() - timedelta(seconds=1))
    assert batches_expire() == 1
    # Nobody writes it yet: the sweeper wakes a writer, and the first that comes takes it.
    assert batch.pk in batches_stuck()
    with transaction.atomic():  # a writer took it a moment ago and is at work
        _begin_ending(Batch.objects.select_for_update().get(pk=batch.pk), Batch.Status.EXPIRED)
    assert batch.pk not in batches_stuck()
    batch_finalize(batch_id=batch.pk)  # a second one, woken meanwhile, leaves it
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS and not batch.error_file_id
    assert not File.objects.filter(tenant=people.tenant).exists()
    # Its writer died: once its stamp is a lease old, the next takes over and finishes.
    Batch.objects.filter(pk=batch.pk).update(ending_at=timezone.now() - timedelta(hours=1))
    assert batch.pk in batches_stuck()
    batch_finalize(batch_id=batch.pk)
    batch.refresh_from_db()
    assert batch.status == Batch.Status.EXPIRED and batch.error_file_id
    assert File.objects.get(pk=batch.error_file_id).lines == 2


def test_the_sweeper_keeps_one_run_queued_for_each_batch_waiting_however_often_it_sweeps(
    people: TenantPeople,
) -> None:
    """Batches waiting their turn (lines ready, no run holding them) get a run message each
    from the sweeper, not one more every sweep: a run message is a turn for whoever's turn it
    is, and with one a batch queued, every batch gets its turn. Before, every sweep (each
    5 s) queued one for each, and under a backlog the queue grew without end."""
    with current_app.connection_for_write() as connection:
        channel: Any = connection.default_channel
        channel.queue_purge(BATCH_QUEUE)
    for _ in range(3):
        _batch(people, lines=2)
    for _ in range(4):
        _sweep()
    assert _queued(BATCH_QUEUE) == 3


def test_a_batch_cancelled_while_its_validator_died_is_settled_by_the_sweepers_wake_up(
    people: TenantPeople,
) -> None:
    """Cancelled while validating, its validator then gone (its lease ran out) and no line
    inserted: no run turn takes it (it has nothing to run), so the run message the sweeper
    sends for it settles it as cancelled, not left ``cancelling`` until it expires."""
    batch = _batch(
        people,
        lines=0,
        status=Batch.Status.CANCELLING,
        in_progress_at=None,
        cancelling_at=timezone.now(),
        validating_until=timezone.now() - timedelta(seconds=1),
    )
    assert batch.pk in batches_stuck()
    batch_run_task(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.CANCELLED


async def test_each_attempt_of_a_line_begins_before_admission() -> None:
    """A line that got past admission once in this run (its lent room was then taken back,
    and the run claimed it again) and that fails before admission this time did not fail on
    an engine: its answer says it did not begin (it counted as a failure, one of the line's
    last attempts, when the first try's admission was remembered)."""
    line = Claimed(pk=7, body=b"{}", attempts=2)
    begun = {line.pk}  # its first attempt in this run was admitted
    plan = Plan(batch_id="batch_x", key=None, pool="spot", endpoint="chat.completions")
    answer = await _run_line(plan, line, begun, Lending(""))
    assert answer.status == 401  # refused before admission (its key was revoked meanwhile)
    assert not answer.begun
