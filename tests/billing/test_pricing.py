"""The price book: exact costs fixed when usage is written, price changes, contract prices,
and the daily rollups that every read of usage comes from."""

from __future__ import annotations

import csv
import io
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command

from billing.models import DailyUsage, Price, UsageRecord
from billing.pricing import micros_to_usd, usage_cost_micros
from billing.services import (
    daily_usage_refresh,
    daily_usage_refresh_stale,
    price_set,
    usage_records_insert,
)
from fleet.models import Model
from tenants.models import AuditEvent, Tenant
from tests.billing.test_usage import _record
from tests.conftest import run_manage
from tests.factories import TenantFactory

NOV = datetime(2026, 11, 1, tzinfo=UTC)
MID_NOV = datetime(2026, 11, 15, 12, tzinfo=UTC)


@pytest.fixture
def model(db: None) -> Model:
    return Model.objects.create(name="tiny-chat", served_name="tiny-chat", context_length=1024)


def _price(model: Model, at: datetime, tenant: Tenant | None = None, **rates: str) -> Price:
    values = {"input": "0.15", "cached": "0.075", "output": "0.60", "discount": "0", **rates}
    return Price.objects.create(
        model=model,
        tenant=tenant,
        input_per_mtok=Decimal(values["input"]),
        cached_input_per_mtok=Decimal(values["cached"]),
        output_per_mtok=Decimal(values["output"]),
        batch_discount_percent=Decimal(values["discount"]),
        effective_from=at,
    )


def _insert(tenant: Tenant, at: datetime, **fields: Any) -> UsageRecord:
    record = _record(tenant, started_at=at.isoformat(), finished_at=at.isoformat(), **fields)
    usage_records_insert([record])
    return UsageRecord.objects.get(request_id=record.request_id)


def test_cost_is_exact_for_awkward_prices_and_counts(model: Model) -> None:
    price = _price(model, NOV)
    # 901,234 uncached x 0.15 + 333,333 cached x 0.075 + 7 x 0.60 = 160,189.275 micro-dollars
    cost = usage_cost_micros(
        price=price,
        mode="online",
        prompt_tokens=1_234_567,
        cached_tokens=333_333,
        completion_tokens=7,
    )
    assert cost == 160_189
    # Rounded once per record, half up: one token at $0.50/1M is half a micro-dollar.
    half = _price(model, NOV + timedelta(days=1), input="0.5", output="0.5", cached="0.5")
    one = usage_cost_micros(
        price=half, mode="online", prompt_tokens=1, cached_tokens=0, completion_tokens=0
    )
    assert one == 1
    assert micros_to_usd(160_189) == "0.160189" and micros_to_usd(12_000_000) == "12.000000"


def test_batch_discount_applies_to_the_whole_amount_before_rounding(model: Model) -> None:
    price = _price(model, NOV, input="0.333333", output="0.333333", discount="50")
    args: dict[str, Any] = {"prompt_tokens": 2, "cached_tokens": 0, "completion_tokens": 1}
    assert usage_cost_micros(price=price, mode="online", **args) == 1  # 0.999999
    assert usage_cost_micros(price=price, mode="batch", **args) == 0  # 0.4999995


def test_a_priority_class_carries_its_own_price(model: Model) -> None:
    """Standard pays the price as it is, interactive its surcharge, background its discount;
    a batch line (always in the background band) its batch discount, never both."""
    tenant = TenantFactory.create()
    Price.objects.create(
        model=model,
        input_per_mtok=Decimal("0.15"),
        cached_input_per_mtok=Decimal("0.15"),
        output_per_mtok=Decimal("0.60"),
        batch_discount_percent=Decimal(50),
        interactive_surcharge_percent=Decimal(50),
        background_discount_percent=Decimal(40),
        effective_from=NOV,
    )
    usage = {"prompt_tokens": 1000, "completion_tokens": 500}  # 450 at the price as it is
    costs = {
        priority: _insert(tenant, MID_NOV, priority=priority, **usage).cost_micros
        for priority in ("standard", "interactive", "background")
    }
    assert costs == {"standard": 450, "interactive": 675, "background": 270}
    batch = _insert(tenant, MID_NOV, priority="background", mode="batch", **usage)
    assert batch.cost_micros == 225
    assert batch.priority == "background"
    with pytest.raises(ValidationError):  # a discount over 100% would pay the tenant
        price_set(
            model=model,
            input_per_mtok=Decimal(1),
            output_per_mtok=Decimal(1),
            background_discount_percent=Decimal(101),
            actor=None,
        )


def test_records_are_charged_the_price_in_force_when_they_started(model: Model) -> None:
    tenant = TenantFactory.create()
    _price(model, NOV)
    _price(model, MID_NOV, input="0.30", output="1.20", cached="0.30")
    before = _insert(
        tenant, MID_NOV - timedelta(seconds=1), prompt_tokens=1000, completion_tokens=500
    )
    after = _insert(tenant, MID_NOV, prompt_tokens=1000, completion_tokens=500)
    assert before.cost_micros == 1000 * 0.15 + 500 * 0.60 == 450
    assert after.cost_micros == 900
    # A price added later never rewrites what was charged, even one that (entered by hand)
    # claims to have been in force then; and the rollups, recomputed, keep the charged cost.
    _price(model, MID_NOV - timedelta(hours=1), input="9", output="9", cached="9")
    daily_usage_refresh(tenant_id=tenant.pk, day=MID_NOV.date())
    before.refresh_from_db()
    assert before.cost_micros == 450
    assert _rollup_totals(tenant)[2] == 450 + 900


def test_a_contract_price_wins_for_its_tenant_only(model: Model) -> None:
    acme, globex = TenantFactory.create(), TenantFactory.create()
    _price(model, NOV)
    _price(model, NOV, tenant=acme, input="0.10", output="0.40", cached="0.05")
    assert _insert(acme, MID_NOV, prompt_tokens=100, completion_tokens=100).cost_micros == 50
    assert _insert(globex, MID_NOV, prompt_tokens=100, completion_tokens=100).cost_micros == 75
    # Before any price was in force the record is unpriced (blank cost), not free.
    assert _insert(acme, NOV - timedelta(days=1)).cost_micros is None


def test_cached_prompt_tokens_are_charged_at_the_cached_price(model: Model) -> None:
    tenant = TenantFactory.create()
    _price(model, NOV, input="1", cached="0.25", output="2")
    record = _insert(tenant, MID_NOV, prompt_tokens=400, cached_tokens=300, completion_tokens=10)
    assert record.cost_micros == 100 * 1 + 300 * 0.25 + 10 * 2 == 195


def test_export_carries_the_cost(model: Model) -> None:
    tenant = TenantFactory.create(slug="acme")
    _price(model, NOV)
    _insert(tenant, MID_NOV, prompt_tokens=1000, completion_tokens=500)
    out = io.StringIO()
    call_command(
        "export_usage",
        "--tenant",
        "acme",
        "--start",
        "2026-11-01",
        "--end",
        "2026-11-30",
        stdout=out,
    )
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert [r["cost_usd"] for r in rows] == ["0.000450"]


def test_price_set_refuses_the_past_and_audits(model: Model) -> None:
    with pytest.raises(ValidationError) as err:
        price_set(
            model=model,
            input_per_mtok=Decimal("0.1"),
            output_per_mtok=Decimal("0.2"),
            effective_from=datetime.now(UTC) - timedelta(days=1),
            actor=None,
        )
    assert "past" in str(err.value)
    price = price_set(
        model=model, input_per_mtok=Decimal("0.1"), output_per_mtok=Decimal("0.2"), actor=None
    )
    assert price.cached_input_per_mtok == Decimal("0.1")  # defaults to the input price
    event = AuditEvent.objects.get(action="price.set")
    assert event.details["output_per_mtok"] == "0.2"


@pytest.mark.django_db(transaction=True)
def test_set_price_command() -> None:
    Model.objects.create(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    TenantFactory.create(slug="acme")
    ok = run_manage(
        "set_price",
        "tiny-chat",
        "--input",
        "0.15",
        "--output",
        "0.6",
        "--tenant",
        "acme",
        "--batch-discount",
        "50",
        "--interactive-surcharge",
        "25",
        "--background-discount",
        "40",
    )
    assert ok.returncode == 0, ok.stderr
    assert "tiny-chat for acme: input $0.15 cached $0.15 output $0.6 per 1M" in ok.stdout
    assert "interactive +25%, background -40%" in ok.stdout
    price = Price.objects.get()
    assert price.tenant is not None and price.batch_discount_percent == 50
    assert price.interactive_surcharge_percent == Decimal(25)
    assert price.background_discount_percent == Decimal(40)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope", "--input", "1", "--output", "1"], "no model named"),
        (["tiny-chat", "--input", "cheap", "--output", "1"], "--input must be a dollar amount"),
        (["tiny-chat", "--input", "-1", "--output", "1"], "--input must be a non-negative"),
        (["tiny-chat", "--input", "1", "--output", "1e-9"], "--output must be a non-negative"),
        (["tiny-chat", "--input", "1", "--output", "1", "--tenant", "x"], "no tenant"),
        (["tiny-chat", "--input", "1", "--output", "1", "--from", "2020-01-01"], "past"),
        (["tiny-chat", "--input", "1", "--output", "1", "--from", "soon"], "--from must be"),
        (
            ["tiny-chat", "--input", "1", "--output", "1", "--batch-discount", "150"],
            "0-100 percent",
        ),
        (
            ["tiny-chat", "--input", "1", "--output", "1", "--interactive-surcharge", "lots"],
            "--interactive-surcharge must be a percentage",
        ),
        (
            ["tiny-chat", "--input", "1", "--output", "1", "--background-discount", "101"],
            "0-100 percent",
        ),
    ],
)
def test_set_price_bad_input(args: list[str], message: str) -> None:
    Model.objects.create(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    result = run_manage("set_price", *args)
    assert result.returncode != 0
    assert result.stderr.strip().startswith("CommandError:") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not Price.objects.exists()


# --- Rollups ---------------------------------------------------------------------------------


def _ledger_totals(tenant: Tenant) -> tuple[int, int, int]:
    rows = UsageRecord.objects.filter(tenant=tenant)
    return (
        rows.count(),
        sum(r.prompt_tokens + r.completion_tokens for r in rows),
        sum(r.cost_micros or 0 for r in rows),
    )


def _rollup_totals(tenant: Tenant) -> tuple[int, int, int]:
    rows = DailyUsage.objects.filter(tenant=tenant)
    return (
        sum(r.requests for r in rows),
        sum(r.prompt_tokens + r.completion_tokens for r in rows),
        sum(r.cost_micros for r in rows),
    )


def test_rollups_follow_the_ledger_exactly(
    model: Model, django_capture_on_commit_callbacks: Any
) -> None:
    tenant = TenantFactory.create()
    _price(model, NOV)
    records = [
        _record(tenant, started_at=(MID_NOV + timedelta(hours=h)).isoformat(), prompt_tokens=h)
        for h in range(30)  # crosses into the next UTC day
    ]
    records.append(_record(tenant, started_at=MID_NOV.isoformat(), mode="batch", status="error"))
    with django_capture_on_commit_callbacks(execute=True):
        usage_records_insert(records)
    assert daily_usage_refresh_stale() == 2
    assert _rollup_totals(tenant) == _ledger_totals(tenant)
    days = {r.day for r in DailyUsage.objects.filter(tenant=tenant)}
    assert days == {date(2026, 11, 15), date(2026, 11, 16)}
    batch = DailyUsage.objects.get(tenant=tenant, mode="batch")
    assert (batch.requests, batch.errors) == (1, 1)

    # A replay of the same records (the spool after a crash) changes nothing.
    with django_capture_on_commit_callbacks(execute=True):
        usage_records_insert(records[:5])
    daily_usage_refresh_stale()
    assert _rollup_totals(tenant) == _ledger_totals(tenant)
    assert daily_usage_refresh_stale() == 0  # nothing left to do


def test_unpriced_records_are_counted_in_rollups(
    model: Model, django_capture_on_commit_callbacks: Any
) -> None:
    tenant = TenantFactory.create()
    with django_capture_on_commit_callbacks(execute=True):
        usage_records_insert([_record(tenant, started_at=MID_NOV.isoformat())])
    daily_usage_refresh_stale()
    row = DailyUsage.objects.get(tenant=tenant)
    assert (row.unpriced, row.cost_micros) == (1, 0)


def test_rollups_heal_when_redis_lost_the_stale_markers(model: Model) -> None:
    from billing.services import daily_usage_refresh_recent
    from controlplane.redis import redis_sync

    tenant = TenantFactory.create()
    now = datetime.now(UTC)
    usage_records_insert([_record(tenant, started_at=now.isoformat()) for _ in range(3)])
    redis_sync().flushdb()  # a Redis restart: the markers are gone, the rollups never made
    assert daily_usage_refresh_stale() == 0 and not DailyUsage.objects.exists()
    assert daily_usage_refresh_recent() == 1
    assert _rollup_totals(tenant) == _ledger_totals(tenant)
