"""Celery's Redis transport, made to outlive a Redis restart (``CELERY_BROKER_TRANSPORT``).

kombu 5.7.0's Redis transport keeps a copy of every message a worker has taken but not yet
acknowledged (its "ack emulation"), and gives the copies back when the channel closes. When
Redis goes away in the instant a worker acknowledges a message, the acknowledgement fails, the
consumer's connection is lost, and giving the message back runs on a channel whose connection
is already gone: an ``AttributeError`` that kombu does not catch, which Celery treats as
unrecoverable, and the worker exits. Nothing restarts it in a stack run by processes alone, and
the ledger, probes and batches stop until someone does (seen: 1 Redis restart in ~17, with the
worker and beat of ``make run``).

Here giving messages back never takes the worker down, and loses nothing kombu would have
kept: what cannot be given back now is still in Redis's own record of unacknowledged messages,
which the transport restores after its visibility timeout — or it went with a Redis that
restarted empty, whatever the worker did.

Two more ways a worker went quiet for good after Redis came back, every process idle and
tasks queued (``tests/test_broker.py`` failed 2 runs in 12 under load; Celery's stacks and
a dump of kombu's and Celery's state, taken on a signal, found them):

- An acknowledgement that fails because Redis went away (Celery logs "Couldn't ack") left the
  message counted as in hand for good: kombu forgets a message only once its acknowledgement
  reached Redis. Enough of them filled the prefetch, and a worker with its prefetch full
  stops polling its connection. Here such a message is no longer in hand: Redis's record of
  it, if Redis kept one, is restored after the visibility timeout, as for a worker that died.
- On a lost connection Celery 5.7 resets its event loop (``Hub.reset``), which drops every
  reader, among them one in the middle of reading a pool process's result. The reader
  registered again afterwards takes the rest of that message for a header and waits for a
  body that never comes: the job never ends for the worker, its process is never given
  another, and once both processes are so the worker takes nothing more (seen: two jobs
  accepted and never ended, their processes idle, the concurrency semaphore at 0 with six
  waiting). Here the reset first reads such results to their end, as Celery's own shutdown
  does (``ResultHandler._finish_partial_read``): in the test's restarts under load it found a
  half-read result in 3 runs of 6, and every run passed.

Everything else is kombu's and Celery's own.
"""

from __future__ import annotations

import logging
import select
import time
from inspect import isgenerator
from typing import Any, cast

from kombu.asynchronous.hub import Hub
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

log = logging.getLogger(__name__)


class QoS(kombu_redis.QoS):
    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)
        except Exception:
            delivered: dict[str, Any] = self._delivered or {}
            log.warning(
                "could not give %d unacknowledged message(s) back to the broker now; Redis "
                "restores the ones it still holds after the visibility timeout",
                len(delivered),
                exc_info=True,
            )
            delivered.clear()

    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)
        except Exception:
            virtual.QoS.ack(self, delivery_tag)  # not in hand any more, whatever Redis holds
            raise

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except Exception:
            virtual.QoS.ack(self, delivery_tag)
            raise


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel


# --- The event loop's reset on a lost connection, without losing the pool's results -------

_POLL_SECONDS = 0.5
_FINISH_SECONDS = 10.0


def _finish_partial_reads(hub: Hub) -> None:
    """Read to their end the results the event loop had only partly read from the pool's
    processes: its reset would drop the reader in the middle of a message, and the next one
    would take the rest of the message for a header (see the module's docstring)."""
    readers = cast(dict[int, tuple[Any, Any]], hub.readers)
    for fd, (callback, _) in list(readers.items()):
        if not isgenerator(callback) or callback.gi_code.co_name != "_recv_message":
            continue
        log.info("the event loop is reset with a result half read: reading it to its end")
        deadline = time.monotonic() + _FINISH_SECONDS
        while True:
            try:
                next(callback)
            except StopIteration:
                break
            except (OSError, EOFError):
                log.warning("a pool process's result could not be read to its end", exc_info=True)
                break
            if time.monotonic() >= deadline:
                log.warning(
                    "a pool process did not finish writing a result within %ss", _FINISH_SECONDS
                )
                break
            select.select([fd], [], [fd], _POLL_SECONDS)


_reset = Hub.reset


def _reset_keeping_results(self: Hub) -> None:
    _finish_partial_reads(self)
    _reset(self)


Hub.reset = _reset_keeping_results  # type: ignore[method-assign]
