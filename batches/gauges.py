"""What the gateway's ``/metrics`` shows of the batches, counted by the sweeper (every few
seconds, on the worker) and kept in Redis: a scrape reads one key and costs the database
nothing, however many batches, lines and tenants there are."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from django.conf import settings
from django.db.models import Count, Min

from batches.models import Batch, Line
from controlplane.redis import redis_sync

BATCH_GAUGES_KEY = "ip:metrics:batches"


def stale_seconds() -> int:
    """Counts older than this are not shown (the sweeper stopped): the key expires, the
    series are left out and inferplane_state_up{source="batches"} says 0, rather than stale
    counts looking current. Redis expires it: no clock of ours is compared with another."""
    sweep: Any = settings.CELERY_BEAT_SCHEDULE["sweep-batches"]["schedule"]
    return max(120, 4 * int(sweep))


_ACTIVE = (Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING, Batch.Status.FINALIZING)


class BatchGauges(msgspec.Struct, frozen=True):
    at: float  # when they were counted (epoch seconds)
    lines: dict[str, int]  # lines of the batches under way, by state
    batches: dict[str, int]  # batches not finished, by status
    deadline: float | None  # the nearest completion window's end of a batch in progress


def batch_gauges_count() -> BatchGauges:
    lines = dict(
        Line.objects.filter(batch__status__in=_ACTIVE)
        .values_list("state")
        .annotate(n=Count("id"))
        .values_list("state", "n")
    )
    batches = dict(
        Batch.objects.exclude(status__in=Batch.FINISHED)
        .values_list("status")
        .annotate(n=Count("id"))
        .values_list("status", "n")
    )
    nearest = Batch.objects.filter(status=Batch.Status.IN_PROGRESS).aggregate(at=Min("expires_at"))[
        "at"
    ]
    return BatchGauges(
        at=time.time(),
        lines={state: int(lines.get(state, 0)) for state in Line.State.values},
        batches={
            status: int(batches.get(status, 0))
            for status in Batch.Status.values
            if status not in Batch.FINISHED
        },
        deadline=nearest.timestamp() if nearest is not None else None,
    )


def batch_gauges_store() -> BatchGauges:
    gauges = batch_gauges_count()
    redis_sync().set(BATCH_GAUGES_KEY, msgspec.json.encode(gauges), ex=stale_seconds())
    return gauges


def batch_gauges_read() -> BatchGauges | None:
    """The last counts, or None when there are none fresh (raises ``RedisError``)."""
    raw = redis_sync().get(BATCH_GAUGES_KEY)
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=BatchGauges)
    except msgspec.DecodeError:
        return None
