"""Writes for the usage ledger."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import cast

import msgspec
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

import contract
from billing.budget_warnings import budget_warnings_take
from billing.models import DailyUsage, Price, UsageRecord
from billing.pricing import PriceBook
from billing.selectors import ledger_sums
from billing.signals import prices_changed
from controlplane.redis import redis_sync
from inference.models import Model
from tenants.models import Adapter, ApiKey, AuditEvent, Tenant, User
from tenants.services import audit_record

log = logging.getLogger(__name__)

ROLLUP_DIRTY = "ip:usage:dirty"  # set of "tenant_id:YYYY-MM-DD" whose rollups are stale


def _record(data: contract.UsageRecord) -> UsageRecord:
    return UsageRecord(**msgspec.structs.asdict(data))


def usage_records_insert(records: Iterable[contract.UsageRecord]) -> int:
    """Insert records, ignoring any whose request_id is already in the ledger (idempotent).

    A record naming a tenant or key that does not exist is dropped with an error in the log
    (foreign keys are checked at commit, where one bad row would sink the whole batch).
    """
    rows = [_record(r) for r in records]
    tenants = set(
        Tenant.objects.filter(pk__in={r.tenant_id for r in rows}).values_list("pk", flat=True)
    )
    keys = set(
        ApiKey.objects.filter(pk__in={r.api_key_id for r in rows if r.api_key_id}).values_list(
            "pk", flat=True
        )
    )
    valid = []
    for row in rows:
        if row.tenant_id in tenants and (row.api_key_id is None or row.api_key_id in keys):
            valid.append(row)
        else:
            log.error("usage record names an unknown tenant or key, dropped: %s", row.request_id)
    # Costs are fixed here, with the price in force when each request started; a record's
    # cost is never recomputed afterwards.
    book = PriceBook.for_models(r.model for r in valid)
    for row in valid:
        if row.cost_micros is None:
            row.cost_micros = book.cost_micros(row)
    with transaction.atomic():
        UsageRecord.objects.bulk_create(valid, ignore_conflicts=True, batch_size=500)
        stale = {f"{r.tenant_id}:{r.started_at.astimezone(UTC).date()}" for r in valid}
        if stale:
            transaction.on_commit(lambda: redis_sync().sadd(ROLLUP_DIRTY, *stale))
        _adapters_last_used(valid)
    return len(valid)


def _adapters_last_used(rows: Iterable[UsageRecord]) -> None:
    """Adapters' ``last_used_at`` from the records (``adapter`` is ``name:version``)."""
    latest: dict[tuple[int, str, int], datetime] = {}
    for row in rows:
        name, _, number = row.adapter.rpartition(":")
        if name and number.isdigit():
            key = (row.tenant_id, name, int(number))
            if key not in latest or row.finished_at > latest[key]:
                latest[key] = row.finished_at
    for (tenant_id, name, version), when in latest.items():
        Adapter.objects.filter(tenant_id=tenant_id, name=name, version=version).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=when)
        ).update(last_used_at=when)


# --- Rollups ---------------------------------------------------------------------------------


@transaction.atomic
def daily_usage_refresh(*, tenant_id: int, day: date) -> int:
    """Recompute one tenant's rollup rows for one UTC day from the ledger (exact, idempotent)."""
    if connection.vendor == "postgresql":
        # One refresh of a (tenant, day) at a time: two concurrent ones would each delete
        # what they see and both insert, doubling the day.
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [tenant_id, day.toordinal()])
    start = datetime.combine(day, time.min, tzinfo=UTC)
    groups = ledger_sums(
        tenant_id=tenant_id,
        start=start,
        end=start + timedelta(days=1),
        by=("api_key_id", "model", "adapter", "mode"),
    )
    rows = [
        DailyUsage(
            day=day,
            tenant_id=tenant_id,
            api_key_id=g["api_key_id"],
            model=g["model"],
            adapter=g["adapter"],
            mode=g["mode"],
            requests=g["n"],
            errors=g["errors"],
            prompt_tokens=g["prompt"],
            completion_tokens=g["completion"],
            cached_tokens=g["cached"],
            cost_micros=g["cost"],
            unpriced=g["unpriced"],
        )
        for g in groups
    ]
    DailyUsage.objects.filter(tenant_id=tenant_id, day=day).delete()
    DailyUsage.objects.bulk_create(rows)
    return len(rows)


def daily_usage_refresh_stale(*, limit: int = 500) -> int:
    """Refresh the rollups of (tenant, day) pairs that got new records. A pair that fails
    goes back into the set for the next run."""
    client = redis_sync()
    pairs = cast(list[bytes], client.spop(ROLLUP_DIRTY, limit) or [])
    done = 0
    try:
        for raw in pairs:
            tenant_id, day = raw.decode().split(":")
            daily_usage_refresh(tenant_id=int(tenant_id), day=date.fromisoformat(day))
            done += 1
    finally:
        if done < len(pairs):  # put back what this run did not get to
            client.sadd(ROLLUP_DIRTY, *pairs[done:])
    return done


def daily_usage_refresh_recent(*, days: int = 2) -> int:
    """Recompute the last ``days`` UTC days for every tenant with usage in them: the safety
    net for stale markers lost with Redis (hourly)."""
    today = timezone.now().astimezone(UTC).date()
    first = today - timedelta(days=days - 1)
    since = datetime.combine(first, time.min, tzinfo=UTC)
    pairs = (
        UsageRecord.objects.filter(started_at__gte=since)
        .values_list("tenant_id", "started_at__date")
        .distinct()
    )
    done = 0
    for tenant_id, day in pairs:
        daily_usage_refresh(tenant_id=tenant_id, day=day)
        done += 1
    return done


# --- Prices ----------------------------------------------------------------------------------


def price_set(
    *,
    model: Model,
    input_per_mtok: Decimal,
    cached_input_per_mtok: Decimal | None = None,
    output_per_mtok: Decimal,
    batch_discount_percent: Decimal = Decimal(0),
    effective_from: datetime | None = None,
    tenant: Tenant | None = None,
    actor: User | None,
) -> Price:
    """Add a price from ``effective_from`` on (default: now). The past is never repriced: a
    price can only start now or later, and one already in force is never edited."""
    now = timezone.now()
    effective_from = effective_from or now
    if effective_from < now - timedelta(minutes=1):
        raise ValidationError(
            {
                "effective_from": "A price cannot start in the past: usage already written keeps "
                "the price it was charged at."
            }
        )
    price = Price(
        model=model,
        tenant=tenant,
        input_per_mtok=input_per_mtok,
        cached_input_per_mtok=(
            input_per_mtok if cached_input_per_mtok is None else cached_input_per_mtok
        ),
        output_per_mtok=output_per_mtok,
        batch_discount_percent=batch_discount_percent,
        effective_from=effective_from,
    )
    price.full_clean()
    with transaction.atomic():
        price.save()
        audit_record(
            actor=actor,
            tenant=tenant,
            action="price.set",
            target=price,
            details={
                "model": model.name,
                "input_per_mtok": str(price.input_per_mtok),
                "cached_input_per_mtok": str(price.cached_input_per_mtok),
                "output_per_mtok": str(price.output_per_mtok),
                "batch_discount_percent": str(price.batch_discount_percent),
                "effective_from": price.effective_from.isoformat(),
            },
        )
        prices_changed.send(sender=Price, price=price)
    return price


# --- Budget warnings -------------------------------------------------------------------------


def budget_warnings_flush(*, max_items: int = 500) -> int:
    """Turn the gateway's "80% of a monthly budget used" notices into audit events, once per
    tenant or key, budget kind and month (a notice repeated after a Redis restart is not)."""
    warnings, unreadable = budget_warnings_take(max_items)
    for raw in unreadable:
        log.error("malformed budget warning dropped: %r", raw)
    written = 0
    for warning in warnings:
        kind, month, used, limit = warning.kind, warning.month, warning.used, warning.limit
        try:
            target: Tenant | ApiKey
            if warning.scope == "t":
                target = Tenant.objects.get(pk=warning.ident)
                tenant = target
            else:
                target = ApiKey.objects.select_related("tenant").get(pk=warning.ident)
                tenant = target.tenant
        except (Tenant.DoesNotExist, ApiKey.DoesNotExist):
            log.error("orphaned budget warning dropped: %r", warning)
            continue
        month_label = f"{month[:4]}-{month[4:]}"
        seen = AuditEvent.objects.filter(
            tenant=tenant,
            action="budget.warning",
            target_type=type(target).__name__.lower(),
            target_id=str(target.pk),
            details__kind=kind,
            details__month=month_label,
        )
        if seen.exists():
            continue
        audit_record(
            actor=None,
            tenant=tenant,
            action="budget.warning",
            target=target,
            details={
                "kind": kind,  # "tokens" or "spend" (micro-dollars)
                "month": month_label,
                "used": used,
                "limit": limit,
                "percent": round(100 * used / limit, 1),
            },
        )
        written += 1
    return written
