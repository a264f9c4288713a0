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
restarted empty, whatever the worker did. Everything else is kombu's own transport.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis

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


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel
