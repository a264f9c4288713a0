"""Reads of the usage ledger."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import date, datetime, timedelta
from typing import Any

from django.db.models import Count, Q, QuerySet, Sum
from django.db.models.functions import Coalesce

from billing.models import DailyUsage, Invoice, Price, UsageRecord
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


def rollup_sums() -> dict[str, Sum]:
    """The sums every read of ``DailyUsage`` reports, by the names it reports them under."""
    return {
        name: Sum(name)
        for name in (
            "requests",
            "errors",
            "cache_hits",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "cost_micros",
        )
    }


def daily_usage_buckets(
    *,
    tenant: Tenant | None,
    start: date,
    days: int,
    group_by: Sequence[str] = (),
) -> list[tuple[date, list[dict[str, Any]]]]:
    """Usage per UTC day from the rollups, ``days`` buckets from ``start``, each with one
    result per combination of ``group_by`` (``model``, ``api_key``, ``mode``, ``adapter``,
    ``priority``) that had usage.
    ``tenant=None`` is every tenant (platform staff only: the caller checks)."""
    fields = {
        "model": "model",
        "api_key": "api_key__prefix",
        "mode": "mode",
        "adapter": "adapter",
        "priority": "priority",
    }
    columns = [fields[g] for g in group_by]
    rows = DailyUsage.objects.filter(day__gte=start, day__lt=start + timedelta(days=days))
    if tenant is not None:
        rows = rows.filter(tenant=tenant)
    sums = (
        rows.values("day", *columns)
        .annotate(**rollup_sums(), unpriced=Sum("unpriced"))
        .order_by("day", *columns)
    )
    by_day: dict[date, list[dict[str, Any]]] = {}
    for row in sums:
        by_day.setdefault(row["day"], []).append(row)
    return [
        (start + timedelta(days=i), by_day.get(start + timedelta(days=i), [])) for i in range(days)
    ]


EXPORT_COLUMNS = (
    "id",
    "request_id",
    "api_key__prefix",
    "model",
    "adapter",
    "mode",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cost_micros",
    "started_at",
    "finished_at",
    "priority",
    "pool",
)


_STARTED_AT = EXPORT_COLUMNS.index("started_at")


def usage_row_pages(
    *, tenant: Tenant, start: datetime, end: datetime, page_size: int = 5000
) -> Iterator[list[tuple[Any, ...]]]:
    """The tenant's records in ``[start, end)`` as pages of tuples (``EXPORT_COLUMNS``), by
    keyset on (started_at, id): each page is one index range scan starting where the last
    one stopped, so memory stays flat, the cost per page does not grow with the offset, and
    any page can be fetched in any thread (an async response fetches them one by one)."""
    rows = UsageRecord.objects.filter(tenant=tenant, started_at__lt=end).values_list(
        *EXPORT_COLUMNS
    )
    page = list(rows.filter(started_at__gte=start).order_by("started_at", "id")[:page_size])
    while page:
        yield page
        at, last_id = page[-1][_STARTED_AT], page[-1][0]
        page = list(
            rows.filter(started_at__gte=at)
            .filter(Q(started_at__gt=at) | Q(id__gt=last_id))
            .order_by("started_at", "id")[:page_size]
        )


def invoice_list(*, tenant: Tenant) -> QuerySet[Invoice]:
    return Invoice.objects.filter(tenant=tenant).order_by("-period_start")


def invoice_get(*, tenant: Tenant, invoice_id: int) -> Invoice:
    """Raises ``Invoice.DoesNotExist`` for another tenant's invoice, as for a missing one."""
    return Invoice.objects.prefetch_related("lines").get(tenant=tenant, pk=invoice_id)


def ledger_sums(
    *, tenant_id: int, start: datetime, end: datetime, by: Sequence[str]
) -> QuerySet[UsageRecord, dict[str, Any]]:
    """The tenant's records in ``[start, end)`` summed per ``by`` columns: ``n``, ``errors``,
    ``prompt``, ``completion``, ``cached``, ``cost`` (priced records) and ``unpriced``. What
    both the rollups and the invoices are made of (and ``hits``: answered from the cache)."""
    rows: QuerySet[UsageRecord, dict[str, Any]] = (
        UsageRecord.objects.filter(tenant_id=tenant_id, started_at__gte=start, started_at__lt=end)
        .values(*by)
        .annotate(
            n=Count("id"),
            errors=Count("id", filter=Q(status=UsageRecord.Status.ERROR)),
            hits=Count("id", filter=Q(status=UsageRecord.Status.CACHE_HIT)),
            prompt=Coalesce(Sum("prompt_tokens"), 0),
            completion=Coalesce(Sum("completion_tokens"), 0),
            cached=Coalesce(Sum("cached_tokens"), 0),
            cost=Coalesce(Sum("cost_micros"), 0),
            unpriced=Count("id", filter=Q(cost_micros__isnull=True)),
        )
        .order_by(*by)
    )
    return rows


def price_list(*, limit: int = 200) -> QuerySet[Price]:
    """The price book, newest first: list prices and tenants' contract prices."""
    return Price.objects.select_related("model", "tenant").order_by("-effective_from", "-pk")[
        :limit
    ]
