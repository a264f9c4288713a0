"""Reads for the dashboard pages. Numbers come from the daily rollups (``DailyUsage``), so a
page costs the same whether the tenant made a thousand requests this month or ten million."""

from __future__ import annotations

from datetime import date, timedelta
from typing import Any

from django.db.models import Q, QuerySet, Sum

from billing.models import DailyUsage, UsageRecord
from billing.selectors import daily_usage_buckets
from tenants.models import Tenant


def month_summary(*, tenant: Tenant, today: date) -> dict[str, int]:
    """This calendar month (UTC) so far: requests, errors, tokens, spend (micro-dollars)."""
    sums = DailyUsage.objects.filter(
        tenant=tenant, day__gte=today.replace(day=1), day__lte=today
    ).aggregate(
        requests=Sum("requests"),
        errors=Sum("errors"),
        prompt=Sum("prompt_tokens"),
        completion=Sum("completion_tokens"),
        cost=Sum("cost_micros"),
    )
    summary = {name: int(value or 0) for name, value in sums.items()}
    summary["tokens"] = summary["prompt"] + summary["completion"]
    return summary


def daily_chart(*, tenant: Tenant, start: date, days: int) -> dict[str, Any]:
    """Tokens and spend per day and model, shaped for the chart (one dataset per model)."""
    buckets = daily_usage_buckets(tenant=tenant, start=start, days=days, group_by=["model"])
    models = sorted({row["model"] for _, rows in buckets for row in rows})
    tokens = {m: [0] * days for m in models}
    spend = [0.0] * days
    for i, (_, rows) in enumerate(buckets):
        for row in rows:
            tokens[row["model"]][i] += row["prompt_tokens"] + row["completion_tokens"]
            spend[i] += (row["cost_micros"] or 0) / 1_000_000
    return {
        "labels": [(start + timedelta(days=i)).isoformat() for i in range(days)],
        "tokens": [{"model": m, "data": tokens[m]} for m in models],
        "spend": [round(v, 6) for v in spend],
    }


def recent_problems(*, tenant: Tenant, limit: int = 10) -> QuerySet[UsageRecord]:
    """The tenant's latest requests that did not end well (a partial index keeps this cheap
    however large the ledger)."""
    return (
        UsageRecord.objects.filter(tenant=tenant)
        .filter(~Q(status=UsageRecord.Status.OK))
        .select_related("api_key")
        .order_by("-started_at")[:limit]
    )
