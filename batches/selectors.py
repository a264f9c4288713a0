"""Reads of batches, always through the tenant that owns them where a tenant asks; the
sweeper's and the turns' reads of work nobody is doing."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Sum
from django.utils import timezone

from batches.models import Batch, Line
from inference.gateway.errors import ApiError
from tenants.models import Tenant


def batch_get(*, tenant: Tenant, batch_id: str) -> Batch:
    """Another tenant's batch is as unknown as one that does not exist (404)."""
    found = Batch.objects.filter(tenant=tenant, pk=batch_id).first()
    if found is None:
        raise ApiError(404, f"No such batch: {batch_id}", code="batch_not_found", param="batch_id")
    return found


def batch_list(*, tenant: Tenant) -> QuerySet[Batch]:
    return Batch.objects.filter(tenant=tenant).order_by("-created_at", "-pk")


def batch_line_counts(batch: Batch) -> dict[str, int]:
    states = dict(
        Line.objects.filter(batch=batch).values_list("state").annotate(n=Count("pk")).order_by()
    )
    done = states.get(Line.State.DONE, 0)
    failed = sum(
        states.get(s, 0) for s in (Line.State.FAILED, Line.State.CANCELLED, Line.State.EXPIRED)
    )
    return {"total": sum(states.values()), "completed": done, "failed": failed}


def batch_usage(batch: Batch) -> dict[str, Any]:
    sums = Line.objects.filter(
        batch=batch, state__in=(Line.State.DONE, Line.State.FAILED)
    ).aggregate(
        prompt=Sum("prompt_tokens", default=0),
        completion=Sum("completion_tokens", default=0),
        cached=Sum("cached_tokens", default=0),
    )
    return {
        "input_tokens": sums["prompt"],
        "input_tokens_details": {"cached_tokens": sums["cached"]},
        "output_tokens": sums["completion"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": sums["prompt"] + sums["completion"],
    }


def free(hold: str, now: datetime) -> Q:
    """Batches nobody holds: ``hold`` (``validating_until``, ``running_until``) unset or past."""
    return Q(**{f"{hold}__isnull": True}) | Q(**{f"{hold}__lt": now})


def batches_runnable(now: datetime) -> QuerySet[Batch]:
    """Running batches with work nobody is doing (no run holds them): lines ready to run
    and none on a live lease, lines whose lease ran out (their worker died), or nothing left
    to run and no ending begun (the last worker died before finalizing)."""
    lines = Line.objects.filter(batch=OuterRef("pk"))
    ready = lines.filter(state=Line.State.PENDING).filter(
        Q(lease_until__isnull=True) | Q(lease_until__lt=now)
    )
    live = lines.filter(state=Line.State.RUNNING, lease_until__gte=now)
    dead = lines.filter(state=Line.State.RUNNING, lease_until__lt=now)
    unfinished = lines.filter(state__in=(Line.State.PENDING, Line.State.RUNNING))
    return (
        Batch.objects.filter(
            status__in=(Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING),
            ending_at__isnull=True,
        )
        .filter(free("running_until", now))
        .filter(
            (Exists(ready) & ~Exists(live))
            | Exists(dead)
            | (~Exists(unfinished) & Q(in_progress_at__isnull=False))
        )
    )


def batches_stuck() -> list[str]:
    """Batches with work nobody is doing: running ones (``batches_runnable``), validating
    ones whose validator's lease ran out (or that never got one), ending ones whose writer's
    stamp is old. The sweeper wakes a worker for each."""
    now = timezone.now()
    stale = now - timedelta(seconds=settings.INFERPLANE_BATCH_LEASE_SECONDS)
    running = batches_runnable(now)
    validating = Batch.objects.filter(
        status__in=(Batch.Status.VALIDATING, Batch.Status.CANCELLING), in_progress_at__isnull=True
    ).filter(
        Q(validating_until__lt=now)
        | Q(validating_until__isnull=True, created_at__lt=now - timedelta(seconds=30))
    )
    ending = (
        Batch.objects.filter(ending_at__isnull=False)
        .exclude(status__in=Batch.FINISHED)
        .filter(ending_at__lt=stale)
    )
    ids = set(running.values_list("pk", flat=True))
    ids |= set(validating.exclude(ending_at__isnull=False).values_list("pk", flat=True))
    ids |= set(ending.values_list("pk", flat=True))
    return sorted(ids)


def batch_lines_by_state(batch: Batch) -> dict[str, int]:
    """How many of the batch's lines are in each state (every state named, 0 included)."""
    found = dict(
        Line.objects.filter(batch=batch).values_list("state").annotate(n=Count("pk")).order_by()
    )
    return {state: found.get(state, 0) for state in Line.State.values}


def batch_cost_micros(batch: Batch) -> int:
    """What the batch has cost so far, in micro-dollars: what its answered lines' records
    (theirs and their guard's) were billed, kept on each line when it was stored."""
    return int(
        Line.objects.filter(batch=batch).aggregate(cost=Sum("cost_micros", default=0))["cost"]
    )


def batch_lines_failed(batch: Batch, *, limit: int = 20) -> list[Line]:
    """The first failed lines, in input order: what the dashboard shows of the error file."""
    return list(
        Line.objects.filter(batch=batch, state=Line.State.FAILED)
        .only("number", "custom_id", "status_code", "response")
        .order_by("number")[:limit]
    )
