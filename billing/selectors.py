"""Reads of the usage ledger."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import date, datetime, timedelta
from typing import Any

from django.db.models import Q, QuerySet, Sum

from billing.models import DailyUsage, Invoice, UsageRecord
from tenants.models import Tenant


def usage_records_for_export(
    *, tenant: Tenant, start: datetime, end: datetime
) -> Iterator[UsageRecord]:
    """The tenant's records with ``start <= started_at < end``, streamed (constant memory)."""
    return (
        UsageRecord.objects.filter(tenant=tenant, started_at__gte=start, started_at__lt=end)
        .select_related("api_key")
        .order_by("started_at", "id")
        .iterator(chunk_size=5000)
    )


def daily_usage_buckets(
    *,
    tenant: Tenant | None,
    start: date,
    days: int,
    group_by: Sequence[str] = (),
) -> list[tuple[date, list[dict[str, Any]]]]:
    """Usage per UTC day from the rollups, ``days`` buckets from ``start``, each with one
    result per combination of ``group_by`` (``model``, ``api_key``, ``mode``) that had usage.
    ``tenant=None`` is every tenant (platform staff only: the caller checks)."""
    fields = {"model": "model", "api_key": "api_key__prefix", "mode": "mode"}
    columns = [fields[g] for g in group_by]
    rows = DailyUsage.objects.filter(day__gte=start, day__lt=start + timedelta(days=days))
    if tenant is not None:
        rows = rows.filter(tenant=tenant)
    sums = (
        rows.values("day", *columns)
        .annotate(
            requests=Sum("requests"),
            errors=Sum("errors"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            cached_tokens=Sum("cached_tokens"),
            cost_micros=Sum("cost_micros"),
            unpriced=Sum("unpriced"),
        )
        .order_by("day", *columns)
    )
    by_day: dict[date, list[dict[str, Any]]] = {}
    for row in sums:
        by_day.setdefault(row["day"], []).append(row)
    return [
        (start + timedelta(days=i), by_day.get(start + timedelta(days=i), [])) for i in range(days)
    ]


def usage_record_pages(
    *, tenant: Tenant, start: datetime, end: datetime, page_size: int = 5000
) -> Iterator[list[UsageRecord]]:
    """The tenant's records in ``[start, end)`` as pages, by keyset on (started_at, id): each
    page is one indexed query, so memory stays flat and any page can be fetched in any
    thread (an async response fetches them one by one)."""
    base = UsageRecord.objects.filter(tenant=tenant, started_at__lt=end).select_related("api_key")
    after: tuple[datetime, int] | None = None
    while True:
        rows = base.filter(started_at__gte=start)
        if after is not None:
            rows = rows.filter(Q(started_at__gt=after[0]) | Q(started_at=after[0], id__gt=after[1]))
        page = list(rows.order_by("started_at", "id")[:page_size])
        if not page:
            return
        yield page
        after = (page[-1].started_at, page[-1].pk)


def invoice_list(*, tenant: Tenant) -> QuerySet[Invoice]:
    return Invoice.objects.filter(tenant=tenant).order_by("-period_start")


def invoice_get(*, tenant: Tenant, invoice_id: int) -> Invoice:
    """Raises ``Invoice.DoesNotExist`` for another tenant's invoice, as for a missing one."""
    return Invoice.objects.prefetch_related("lines").get(tenant=tenant, pk=invoice_id)
