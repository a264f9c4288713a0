"""CSV shapes shared by the ``export_usage`` command and the finance API."""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator, Iterable
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async

from billing.models import InvoiceLine, UsageRecord
from billing.pricing import micros_to_usd
from billing.selectors import usage_row_pages
from tenants.keys import KEY_TAG
from tenants.models import Tenant

USAGE_HEADER = [
    "request_id",
    "tenant",
    "api_key",
    "model",
    "adapter",
    "mode",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cost_usd",
    "started_at",
    "finished_at",
    # Added after the columns above (a reader by position keeps working): the priority
    # class it ran in (its price may differ: docs/priority.md) and the pool that served it
    # (a batch line on an online pool's lent room names that pool).
    "priority",
    "pool",
]

LINE_HEADER = [
    "invoice_id",
    "tenant",
    "period",
    "model",
    "mode",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost_usd",
    "amount_usd",
]


# What a spreadsheet reads as the start of a formula (OWASP's list for CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(text: str) -> str:
    """Free text a tenant chose (a key's name), as a CSV cell a spreadsheet shows as text:
    ``=HYPERLINK(...)`` gets a leading apostrophe instead of running when finance opens it."""
    return f"'{text}" if text.startswith(FORMULA_STARTS) else text


def usage_row(r: UsageRecord, tenant_slug: str) -> list[Any]:
    return [
        r.request_id,
        tenant_slug,
        f"{KEY_TAG}{r.api_key.prefix}" if r.api_key else "",
        r.model,
        r.adapter,
        r.mode,
        r.status,
        r.prompt_tokens,
        r.completion_tokens,
        r.cached_tokens,
        "" if r.cost_micros is None else micros_to_usd(r.cost_micros),
        r.started_at.isoformat(),
        r.finished_at.isoformat(),
        r.priority,
        r.pool,
    ]


def _export_row(row: tuple[Any, ...], slug: str) -> list[Any]:
    _, rid, prefix, model, adapter, mode, status, prompt, completion, cached, cost, *rest = row
    started, done, priority, pool = rest
    return [
        rid,
        slug,
        f"{KEY_TAG}{prefix}" if prefix else "",
        model,
        adapter,
        mode,
        status,
        prompt,
        completion,
        cached,
        "" if cost is None else micros_to_usd(cost),
        started.isoformat(),
        done.isoformat(),
        priority,
        pool,
    ]


def _csv(rows: Iterable[list[Any]]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


async def usage_csv_stream(*, tenant: Tenant, start: datetime, end: datetime) -> AsyncIterator[str]:
    """The usage CSV, one page of records per chunk, fetched as it is sent (flat memory)."""
    yield _csv([USAGE_HEADER])
    pages = usage_row_pages(tenant=tenant, start=start, end=end)
    slug = tenant.slug

    def next_chunk() -> str | None:
        page = next(pages, None)
        if page is None:
            return None
        return _csv(_export_row(row, slug) for row in page)

    while (chunk := await sync_to_async(next_chunk)()) is not None:
        yield chunk


def invoice_lines_csv(lines: Iterable[InvoiceLine], tenant_slug: str) -> str:
    rows: list[list[Any]] = [LINE_HEADER]
    for line in lines:
        invoice = line.invoice
        rows.append(
            [
                invoice.pk,
                tenant_slug,
                f"{invoice.period_start:%Y-%m}",
                line.model,
                line.mode,
                line.requests,
                line.prompt_tokens,
                line.cached_tokens,
                line.completion_tokens,
                micros_to_usd(line.cost_micros),
                f"{line.amount_cents // 100}.{line.amount_cents % 100:02d}",
            ]
        )
    return _csv(rows)
