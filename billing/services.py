"""Writes for the usage ledger."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import cast

import msgspec
from django.core.exceptions import ValidationError
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.backends.utils import CursorWrapper
from django.utils import timezone

import contract
from billing.budget_warnings import BudgetWarning, budget_warnings_put_back, budget_warnings_take
from billing.models import DailyUsage, Price, UsageRecord
from billing.pricing import PriceBook
from billing.selectors import ledger_sums
from billing.signals import adapters_used, prices_changed
from controlplane.redis import redis_sync
from fleet.models import Model
from tenants.models import ApiKey, AuditEvent, Tenant, User
from tenants.services import audit_record

log = logging.getLogger(__name__)

ROLLUP_DIRTY = "ip:usage:dirty"  # set of "tenant_id:YYYY-MM-DD" whose rollups are stale


# The ledger's columns are the contract's fields, in its order (``cost_micros`` last).
_COLUMNS = [f.name for f in msgspec.structs.fields(contract.UsageRecord)]
_NAMES = ", ".join(_COLUMNS)
_TABLE = UsageRecord._meta.db_table
# A batch is copied (COPY, the fastest way into PostgreSQL) into a session's temporary
# table, then moved into the ledger by one statement that skips what is already there.
_STAGE = "usage_in"


_KEYS = ("tenant_id", "api_key_id")  # foreign keys: the field is named without "_id"


def _stage_create() -> str:
    """The staging table, typed like the ledger's columns but not derived from the ledger
    table (``CREATE … AS SELECT`` from it would lock the ledger before the tenants, the
    reverse of every other writer's order)."""
    fields = [
        UsageRecord._meta.get_field(name.removesuffix("_id") if name in _KEYS else name)
        for name in _COLUMNS
    ]
    columns = ", ".join(
        f"{name} {field.db_type(connection)}" for name, field in zip(_COLUMNS, fields, strict=True)
    )
    return f"CREATE TEMPORARY TABLE IF NOT EXISTS {_STAGE} ({columns}) ON COMMIT DELETE ROWS"


_KNOWN = (
    "EXISTS (SELECT 1 FROM tenants_tenant t WHERE t.id = s.tenant_id) AND (s.api_key_id IS "
    "NULL OR EXISTS (SELECT 1 FROM tenants_apikey k WHERE k.id = s.api_key_id))"
)
_UNKNOWN = f"SELECT request_id FROM {_STAGE} s WHERE NOT ({_KNOWN})"  # noqa: S608
_MOVE = (
    f"INSERT INTO {_TABLE} ({_NAMES}) SELECT {_NAMES} FROM {_STAGE} s WHERE {_KNOWN} "  # noqa: S608
    "ORDER BY request_id ON CONFLICT (request_id) DO NOTHING"
)


_stage_oids: list[int] = []


def _stage_types(cursor: CursorWrapper) -> list[int]:
    """The staging table's column types (built-in types: the same OIDs in every database),
    for the binary COPY, which sends each value in its column's own format."""
    if not _stage_oids:
        cursor.execute(
            "SELECT atttypid FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum",
            [_STAGE],
        )
        _stage_oids[:] = [int(oid) for (oid,) in cursor.fetchall()]
    return _stage_oids


def usage_records_insert(records: Iterable[contract.UsageRecord]) -> int:
    """Insert records, ignoring any whose request_id is already in the ledger (idempotent).

    A batch is COPYed (binary) into a temporary table and moved into the ledger with one ``INSERT …
    SELECT … ON CONFLICT DO NOTHING``, so the cost per record is the database's, not an
    ORM's (several times the rate of ``bulk_create``: ``bench/scale.py``). Rows go in
    ``request_id`` order, so two flushers inserting overlapping batches wait on each other
    rather than deadlock.

    A record naming a tenant or key that does not exist is dropped with an error in the log
    (a foreign key refused at commit would sink the whole batch). Returns how many of the
    records the ledger now holds from this call or before (the known ones).
    """
    rows = list(records)
    if not rows:
        return 0
    # Costs are fixed here, with the price in force when each request started; a record's
    # cost is never recomputed afterwards.
    book = PriceBook.for_models({r.model for r in rows})
    with transaction.atomic():
        if connection.vendor == "postgresql":
            unknown = _insert_copy(rows, book)
        else:
            unknown = _insert_orm(rows, book)
        for request_id in unknown:
            log.error("usage record names an unknown tenant or key, dropped: %s", request_id)
        valid = [r for r in rows if r.request_id not in unknown] if unknown else rows
        stale = {f"{r.tenant_id}:{r.started_at.astimezone(UTC).date()}" for r in valid}
        if stale:
            transaction.on_commit(lambda: redis_sync().sadd(ROLLUP_DIRTY, *stale))
        _adapters_last_used(valid)
    return len(valid)


def _priced(row: contract.UsageRecord, book: PriceBook) -> tuple[object, ...]:
    values = msgspec.structs.astuple(row)
    if row.cost_micros is None:
        values = (*values[:-1], book.cost_micros(row))
    return values


def _insert_copy(rows: list[contract.UsageRecord], book: PriceBook) -> set[str]:
    """PostgreSQL: the batch through the staging table. Returns the unknown records' ids."""
    with connection.cursor() as cursor:
        cursor.execute(_stage_create())
        cursor.execute(f"DELETE FROM {_STAGE}")  # noqa: S608 (an outer transaction's rows)
        types = _stage_types(cursor)
        with cursor.cursor.copy(f"COPY {_STAGE} ({_NAMES}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(types)
            for row in rows:
                copy.write_row(_priced(row, book))
        cursor.execute(_UNKNOWN)
        unknown = {request_id for (request_id,) in cursor.fetchall()}
        cursor.execute(_MOVE)
    return unknown


def _insert_orm(rows: list[contract.UsageRecord], book: PriceBook) -> set[str]:
    """Any other database (SQLite, for a first look without PostgreSQL): the ORM."""
    tenants = set(
        Tenant.objects.filter(pk__in={r.tenant_id for r in rows}).values_list("pk", flat=True)
    )
    keys = set(
        ApiKey.objects.filter(pk__in={r.api_key_id for r in rows if r.api_key_id}).values_list(
            "pk", flat=True
        )
    )
    unknown = {
        r.request_id
        for r in rows
        if r.tenant_id not in tenants or (r.api_key_id is not None and r.api_key_id not in keys)
    }
    UsageRecord.objects.bulk_create(
        [
            UsageRecord(**dict(zip(_COLUMNS, _priced(r, book), strict=True)))
            for r in rows
            if r.request_id not in unknown
        ],
        ignore_conflicts=True,
        batch_size=500,
    )
    return unknown


def _adapters_last_used(rows: Iterable[contract.UsageRecord]) -> None:
    """The latest use of each adapter in the records (``adapter`` is ``name:version``),
    announced for the adapters app to stamp (``adapters_used``)."""
    latest: dict[tuple[int, str, int], datetime] = {}
    for row in rows:
        name, _, number = row.adapter.rpartition(":")
        if name and number.isdigit():
            key = (row.tenant_id, name, int(number))
            if key not in latest or row.finished_at > latest[key]:
                latest[key] = row.finished_at
    if latest:
        adapters_used.send(sender=UsageRecord, latest=latest)


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
        by=("api_key_id", "model", "adapter", "mode", "priority"),
    )
    rows = [
        DailyUsage(
            day=day,
            tenant_id=tenant_id,
            api_key_id=g["api_key_id"],
            model=g["model"],
            adapter=g["adapter"],
            mode=g["mode"],
            priority=g["priority"],
            requests=g["n"],
            errors=g["errors"],
            cache_hits=g["hits"],
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
    interactive_surcharge_percent: Decimal = Decimal(0),
    background_discount_percent: Decimal = Decimal(0),
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
        interactive_surcharge_percent=interactive_surcharge_percent,
        background_discount_percent=background_discount_percent,
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
                "interactive_surcharge_percent": str(price.interactive_surcharge_percent),
                "background_discount_percent": str(price.background_discount_percent),
                "effective_from": price.effective_from.isoformat(),
            },
        )
        prices_changed.send(sender=Price, price=price)
    return price


# --- Budget warnings -------------------------------------------------------------------------


def budget_warnings_flush(*, max_items: int = 500, block_seconds: float = 0) -> int:
    """Turn the gateway's "80% of a monthly budget used" notices into audit events, once per
    tenant or key, budget kind and month (a notice repeated after a Redis restart is not).
    With ``block_seconds``, waits that long for a notice when there is none."""
    warnings, unreadable = budget_warnings_take(max_items, block_seconds=block_seconds)
    for raw in unreadable:
        log.error("malformed budget warning dropped: %r", raw)
    written = 0
    for i, warning in enumerate(warnings):
        try:
            written += _budget_warning_record(warning)
        except (OperationalError, InterfaceError):  # the database is away: not lost
            budget_warnings_put_back(warnings[i:])
            raise
    return written


def _budget_warning_record(warning: BudgetWarning) -> int:
    """The warning's audit event, unless it is already there (1 if written)."""
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
        return 0
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
        return 0
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
    return 1


class BudgetWarningsDrain:
    """The notices' consumer in the drains process (``controlplane.drains``)."""

    name = "budget-warnings"

    def reset(self) -> None:
        pass

    def step(self, block_seconds: float) -> int:
        return budget_warnings_flush(block_seconds=block_seconds)
