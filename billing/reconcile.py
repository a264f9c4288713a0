"""Reconciliation: the ledger against the engines' own counters, per replica.

vLLM counts every prompt and generated token it processed (``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, from the engine process's start). Snapshots of those
counters (taken every minute by Celery, and by ``reconcile_usage`` itself) bound a window;
the records of that replica that finished inside it must add up to the counters' growth.
Requests in flight at either edge straddle it, so a window is exact only when both edge
snapshots saw none running; the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import httpx
from django.db.models import Sum
from django.utils import timezone

from billing.models import EngineCounterSnapshot, UsageRecord
from fleet.engine_metrics import engine_metrics_parse
from fleet.models import Pool, Replica

KEEP_DAYS = 40


def replica_counters_snapshot(*, replica: Replica, timeout: float = 5) -> EngineCounterSnapshot:
    text = httpx.get(f"{replica.url}/metrics", timeout=timeout).raise_for_status().text
    values = engine_metrics_parse(text)
    return EngineCounterSnapshot.objects.create(
        replica=replica,
        taken_at=timezone.now(),
        process_started_at=datetime.fromtimestamp(values["started"], tz=UTC),
        prompt_tokens=int(values["prompt"]),
        generation_tokens=int(values["generation"]),
        running=int(values["running"]),
    )


def counter_snapshots_take() -> int:
    """Snapshot every replica that answers (Celery, every minute); forget old snapshots."""
    taken = 0
    for replica in Replica.objects.exclude(state=Replica.State.DOWN):
        try:
            replica_counters_snapshot(replica=replica)
            taken += 1
        except (httpx.HTTPError, ValueError):
            continue  # the probes report unhealthy replicas; a gap here only widens a window
    EngineCounterSnapshot.objects.filter(
        taken_at__lt=timezone.now() - timedelta(days=KEEP_DAYS)
    ).delete()
    return taken


@dataclass(frozen=True)
class ReplicaReconciliation:
    replica: str
    window_start: datetime | None
    window_end: datetime | None
    engine_prompt: int
    engine_generation: int
    ledger_prompt: int
    ledger_completion: int
    records: int
    exact: bool  # nothing in flight at either edge
    note: str = ""

    @property
    def prompt_diff(self) -> int:
        return self.ledger_prompt - self.engine_prompt

    @property
    def generation_diff(self) -> int:
        return self.ledger_completion - self.engine_generation


def usage_reconcile(*, pool: Pool, since: datetime) -> list[ReplicaReconciliation]:
    """For each replica of the pool: from the last snapshot at or before ``since`` (or the
    first after it, of the same engine process) to a snapshot taken now."""
    out = []
    for replica in pool.replicas.order_by("url"):
        try:
            end = replica_counters_snapshot(replica=replica)
        except (httpx.HTTPError, ValueError) as exc:
            out.append(_empty(replica, f"no counters now: {type(exc).__name__}"))
            continue
        same_process = EngineCounterSnapshot.objects.filter(
            replica=replica, process_started_at=end.process_started_at, taken_at__lt=end.taken_at
        )
        start = (
            same_process.filter(taken_at__lte=since).order_by("-taken_at").first()
            or same_process.filter(taken_at__gt=since).order_by("taken_at").first()
        )
        if start is None:
            out.append(_empty(replica, "no earlier snapshot of this engine process"))
            continue
        # The ledger names the replica (records written before replicas had names: its URL).
        ledger = UsageRecord.objects.filter(
            pool=pool.name,
            replica__in=[replica.name, replica.url],
            finished_at__gt=start.taken_at,
            finished_at__lte=end.taken_at,
        ).aggregate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"), n=Sum(1))
        note = ""
        if start.taken_at > since:
            note = f"window starts at the engine's first snapshot after {since:%Y-%m-%d %H:%M}"
        out.append(
            ReplicaReconciliation(
                replica=replica.url,
                window_start=start.taken_at,
                window_end=end.taken_at,
                engine_prompt=end.prompt_tokens - start.prompt_tokens,
                engine_generation=end.generation_tokens - start.generation_tokens,
                ledger_prompt=ledger["prompt"] or 0,
                ledger_completion=ledger["completion"] or 0,
                records=ledger["n"] or 0,
                exact=start.running == 0 and end.running == 0,
                note=note,
            )
        )
    return out


def _empty(replica: Replica, note: str) -> ReplicaReconciliation:
    return ReplicaReconciliation(replica.url, None, None, 0, 0, 0, 0, 0, False, note)
