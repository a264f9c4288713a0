"""Reads of the usage ledger."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from billing.models import UsageRecord
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
