"""The drains: background work driven by events, not by a clock.

What the gateways leave in Redis for Postgres (usage records, moderation events, budget
notices) is moved by long-running consumers, each a thread of the drains process
(``python manage.py run_drains``, the Procfile's ``drains``), each blocked on its stream or
list until there is work (``XREADGROUP``/``XREAD``/``BLPOP``, for at most
``INFERPLANE_DRAIN_BLOCK_SECONDS``). A record reaches Postgres as soon as it is spooled; an
idle platform costs Redis one read per drain per block, and Celery nothing. Any number of
drains processes
may run: each source says in its own module why two consumers never lose or double anything,
and the usage spool's consumer group hands a dead process's records to a live one.

A drain is an object with a ``name``, ``step(block_seconds) -> int`` (wait at most that long
for work, move what came, return how much) and ``reset()`` (forget what it knows of Redis,
after an error: a Redis that restarted empty has lost the group). An error is logged and
retried after a growing pause (up to ``BACKOFF_MAX``); the thread never dies of one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from django.conf import settings
from django.db import close_old_connections

from billing.services import BudgetWarningsDrain
from billing.spool import UsageDrain
from controlplane.redis import disconnect, redis_blocking
from inference.keycache import KeyCacheOutboxDrain
from moderation.services import ModerationEventsDrain

log = logging.getLogger(__name__)

BACKOFF_MAX = 10.0


class Drain(Protocol):
    name: str

    def step(self, block_seconds: float) -> int: ...

    def reset(self) -> None: ...


def drains_all(stop: threading.Event) -> list[Drain]:
    return [
        UsageDrain(),
        ModerationEventsDrain(),
        BudgetWarningsDrain(),
        KeyCacheOutboxDrain(stop),
    ]


def drain_loop(drain: Drain, stop: threading.Event) -> None:
    """Run one drain until ``stop`` is set."""
    backoff = 0.5
    failing = False
    while not stop.is_set():
        close_old_connections()  # a connection the database dropped is not reused
        try:
            drain.step(settings.INFERPLANE_DRAIN_BLOCK_SECONDS)
            if failing:
                log.info("drain %s works again", drain.name)
            backoff, failing = 0.5, False
        except Exception as exc:
            if stop.is_set():  # its blocked read was cut short (``drains_run``)
                return
            # The whole story once, then a line per retry while it lasts (an outage).
            log.warning(
                "drain %s failed; retrying in %.1f s: %s",
                drain.name,
                backoff,
                exc,
                exc_info=not failing,
            )
            failing = True
            drain.reset()
            stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)


# On stop, how long the drains have to finish what they hold (what one does not finish is
# done again by the next drain). A drain blocked waiting for work holds nothing: its read is
# cut short at once.
STOP_GRACE = 2.0


def drains_run(drains: Sequence[Drain], stop: threading.Event) -> None:
    """Run every drain in a thread of its own until ``stop`` is set."""
    threads = [
        threading.Thread(target=drain_loop, args=(d, stop), name=f"drain-{d.name}", daemon=True)
        for d in drains
    ]
    for thread in threads:
        thread.start()
    log.info("drains running: %s", ", ".join(d.name for d in drains))
    while not stop.wait(1):  # (a wait without a timeout would not hear signals everywhere)
        pass
    disconnect(redis_blocking())  # every blocked read ends now
    deadline = time.monotonic() + STOP_GRACE
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
