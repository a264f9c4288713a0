"""The Celery worker against a Redis that restarts while it works (controlplane/broker.py).

A worker holds messages it has taken and not yet acknowledged whenever work queues up behind
its processes. kombu's own Redis transport could crash the worker when Redis went away then
(its "unrecoverable error"), and nothing was run again — usage stayed out of the ledger, the
probes stopped — until someone restarted it.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis as redis_lib

from billing.spool import USAGE_STREAM
from controlplane.celery import app
from tests.conftest import test_database_url
from tests.live import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

FLUSH = "billing.tasks.usage_spool_flush_task"  # what the beat sends every second
BACKLOG = 300  # more than the worker's two processes keep up with: it always holds some
# Without the transport's fix the worker died (or hung) in 2 of 3 runs of 8 restarts, each time
# within 3: 16 leave it ~1% to slip through; with the fix every restart passes (~2 s each).
RESTARTS = 16


def test_the_worker_outlives_redis_restarts_in_the_middle_of_its_work(
    private_redis: tuple[str, Any], stack_factory: Any
) -> None:
    url, (start, kill) = private_redis
    stack = stack_factory(test_database_url(), redis_url=url, name="broker")
    worker = stack.processes["worker"]
    broker = redis_lib.Redis.from_url(url)

    def flushed() -> bool:
        """A usage flush ran since this Redis started (it makes the spool's stream)."""
        return bool(broker.exists(USAGE_STREAM))

    wait_for(flushed, timeout=60)
    for _ in range(RESTARTS):
        with app.connection_for_write(url) as connection:
            for _ in range(BACKLOG):
                app.send_task(FLUSH, connection=connection)
        wait_for(lambda: broker.llen("celery") < BACKLOG)  # it is taking them
        kill()
        start()  # empty: the backlog is gone, the worker's messages in hand with it
        # The worker reconnects (2 s, then 4 s...) and runs the beat's next flush.
        wait_for(lambda: flushed() or worker.poll() is not None, timeout=60)
        assert worker.poll() is None, "the worker exited"
