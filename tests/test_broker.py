"""The Celery worker against a Redis that restarts while it works (controlplane/broker.py).

A worker holds messages it has taken and not yet acknowledged whenever work queues up behind
its processes. kombu's own Redis transport could crash the worker when Redis went away then
(its "unrecoverable error"), and nothing was run again — usage stayed out of the ledger, the
probes stopped — until someone restarted it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, cast

import pytest
import redis as redis_lib
from kombu import Connection, Queue
from kombu.message import Message

from controlplane.celery import app
from inference.catalog import CATALOG_KEY
from tests.conftest import test_database_url
from tests.engines import LOG_DIR
from tests.live import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

PROBE = "inference.tasks.replicas_probe_all"  # what the beat sends (every 2 s in a test stack)
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

    def probed() -> bool:
        """A probe round ran since this Redis started (it publishes the catalog)."""
        return bool(broker.exists(CATALOG_KEY))

    wait_for(probed, timeout=60)
    for _ in range(RESTARTS):
        with app.connection_for_write(url) as connection:
            for _ in range(BACKLOG):
                app.send_task(PROBE, connection=connection)
        wait_for(lambda: broker.llen("celery") < BACKLOG)  # it is taking them
        kill()
        start()  # empty: the backlog is gone, the worker's messages in hand with it
        # The worker reconnects (2 s, then 4 s...) and runs the beat's next probe round.
        try:
            wait_for(lambda: probed() or worker.poll() is not None, timeout=60)
        except AssertionError:
            pytest.fail(f"the worker stopped working; where it is:\n{_stacks(worker.pid)}")
        assert worker.poll() is None, "the worker exited"


def _stacks(pid: int) -> str:
    """The worker's threads' stacks: Celery logs them on SIGUSR1 (its "cry" handler)."""
    log = LOG_DIR / "broker-worker.log"
    before = log.stat().st_size
    os.kill(pid, signal.SIGUSR1)

    def logged() -> str:
        with log.open("rb") as f:
            f.seek(before)
            return f.read(20_000).decode(errors="replace")

    # The handler ends its dump with the main thread's locals; a worker too stuck to answer
    # leaves what it logged, which is all there is.
    with contextlib.suppress(AssertionError):
        wait_for(lambda: "LOCAL VARIABLES" in logged(), timeout=10)
    return logged()


def test_an_acknowledgement_lost_with_redis_does_not_use_up_the_prefetch(
    private_redis: tuple[str, Any],
) -> None:
    """kombu counts a message as in hand until its acknowledgement reaches Redis. One that
    fails because Redis is gone stayed counted for good: a worker whose prefetch filled up
    that way stopped taking messages, and stopped watching its connection (seen: idle, every
    process waiting, while tasks queued)."""
    url, (start, kill) = private_redis
    with Connection(url, transport="controlplane.broker:Transport") as connection:
        channel: Any = connection.default_channel  # kombu's Redis channel
        channel.basic_qos(0, 2, False)
        queue = Queue("probe", channel=channel)
        queue.declare()
        producer = connection.Producer(channel)
        for i in range(2):
            producer.publish({"n": i}, routing_key="probe")
        messages = [queue.get(no_ack=False) for _ in range(2)]
        assert None not in messages
        assert not channel.qos.can_consume()  # the prefetch is full
        kill()
        for message in cast(list[Message], messages):
            with pytest.raises(redis_lib.ConnectionError):  # Celery logs "Couldn't ack"
                message.ack()
        start()
        assert channel.qos.can_consume()  # nothing is in hand any more
