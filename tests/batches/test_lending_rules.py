"""When a batch run's lines ask a lending online pool for room (``batches.runner.Lending``):
the rules that stop a line, or the whole run, from asking."""

from __future__ import annotations

import time

import pytest

from batches.runner import LEND_LOSSES_MAX, LEND_PAUSE_AFTER_FAILURE, Lending
from inference.gateway.errors import LENT_RECLAIMED


def test_a_line_that_lost_its_lent_room_too_often_runs_on_the_spot_pool() -> None:
    """A long line beside an online load that comes and goes would lose its room forever."""
    lending = Lending("online")
    for _ in range(LEND_LOSSES_MAX - 1):
        assert lending.ask(1) == "online"
        lending.ended(1, status=503, code=LENT_RECLAIMED)
    assert lending.ask(1) == "online"
    lending.ended(1, status=503, code=LENT_RECLAIMED)
    assert lending.ask(1) is None  # it asks no more
    assert lending.ask(2) == "online"  # the others still do
    assert lending.freed == 0  # a room taken back is not room freed


def test_a_lending_replica_that_failed_a_line_is_asked_nothing_until_the_probe_can_tell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = 1000.0
    monkeypatch.setattr(time, "monotonic", lambda: now)
    lending = Lending("online")
    lending.ended(1, status=502, code="")
    assert lending.ask(2) is None
    now += LEND_PAUSE_AFTER_FAILURE - 0.1
    assert lending.ask(2) is None
    now += 0.2
    assert lending.ask(2) == "online"


def test_a_lent_line_that_ends_frees_its_room_for_the_next_line() -> None:
    lending = Lending("online")
    lending.ended(1, status=200, code="")
    lending.ended(2, status=400, code="invalid_request_error")  # the line's own error
    assert lending.freed == 2
    assert lending.ask(3) == "online"


def test_a_run_without_a_lending_pool_never_asks() -> None:
    assert Lending("").ask(1) is None
