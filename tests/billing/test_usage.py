"""The usage ledger: idempotent writes, the CSV export (the spool: test_spool.py)."""

from __future__ import annotations

import csv
import io
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from django.conf import settings
from django.core.management import call_command

import contract
from billing.models import UsageRecord
from billing.services import daily_usage_refresh, usage_records_insert
from tenants.models import Tenant
from tenants.services import api_key_create
from tests.conftest import run_manage
from tests.factories import TenantFactory


def _record(tenant: Tenant, **overrides: Any) -> contract.UsageRecord:
    """A record as the gateway writes one (ISO strings for times, as on the wire)."""
    key = api_key_create(tenant=tenant, name="k", created_by=None).api_key
    now = datetime.now(UTC)
    values = {
        "request_id": uuid.uuid4().hex,
        "tenant_id": tenant.pk,
        "api_key_id": key.pk,
        "model": "tiny-chat",
        "adapter": "",
        "endpoint": "chat.completions",
        "mode": "online",
        "status": "ok",
        "prompt_tokens": 11,
        "completion_tokens": 7,
        "cached_tokens": 0,
        "pool": "online",
        "replica": "http://x",
        "ttft_ms": 12,
        "duration_ms": 40,
        "error": "",
        "started_at": now.isoformat(),
        "finished_at": (now + timedelta(milliseconds=40)).isoformat(),
        **overrides,
    }
    return msgspec.convert(values, contract.UsageRecord)


def insert_with_rollups(records: list[contract.UsageRecord]) -> None:
    """Records into the ledger, and the daily rollups of every (tenant, day) they touch."""
    usage_records_insert(records)
    touched = {(r.tenant_id, r.started_at.astimezone(UTC).date()) for r in records}
    for tenant_id, day in touched:
        daily_usage_refresh(tenant_id=tenant_id, day=day)


@pytest.mark.django_db
def test_insert_is_idempotent_on_request_id() -> None:
    tenant = TenantFactory.create()
    record = _record(tenant)
    usage_records_insert([record])
    usage_records_insert([record, record])
    assert UsageRecord.objects.filter(request_id=record.request_id).count() == 1


@pytest.mark.django_db
def test_one_bad_record_does_not_hold_back_the_batch() -> None:
    tenant = TenantFactory.create()
    good, bad = _record(tenant), _record(tenant, tenant_id=10**9)
    usage_records_insert([good, bad])
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == [good.request_id]


@pytest.mark.django_db
def test_export_usage_csv() -> None:
    tenant = TenantFactory.create(slug="acme")
    other = TenantFactory.create(slug="globex")
    inside = _record(tenant, started_at="2026-11-30T23:59:59+00:00")
    usage_records_insert(
        [
            inside,
            _record(tenant, started_at="2026-12-01T00:00:00+00:00"),  # after --end
            _record(tenant, started_at="2026-10-31T23:59:59+00:00"),  # before --start
            _record(other, started_at="2026-11-15T00:00:00+00:00"),  # another tenant
        ]
    )
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
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert ",".join(rows[0]) == (
        "request_id,tenant,api_key,model,adapter,mode,status,prompt_tokens,completion_tokens,"
        "cached_tokens,cost_usd,started_at,finished_at,priority,pool"
    )
    assert len(rows) == 2
    row = dict(zip(rows[0], rows[1], strict=True))
    assert row["request_id"] == inside.request_id and row["tenant"] == "acme"
    assert row["api_key"].startswith("sk-ip-") and row["cost_usd"] == ""
    assert (row["prompt_tokens"], row["completion_tokens"]) == ("11", "7")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tenant", "nope", "--start", "2026-11-01", "--end", "2026-11-02"], "no tenant"),
        (["--tenant", "acme", "--start", "yesterday", "--end", "2026-11-02"], "--start must be"),
        (["--tenant", "acme", "--start", "2026-11-03", "--end", "2026-11-02"], "before --start"),
    ],
)
def test_export_usage_bad_input(args: list[str], message: str) -> None:
    TenantFactory.create(slug="acme")
    result = run_manage("export_usage", *args)
    assert result.returncode != 0
    assert result.stderr.strip().startswith("CommandError:") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_settings_use_the_tests_own_redis() -> None:
    """The tests' Redis databases are 10-15 (one per group of make test); make run's is 0."""
    assert 10 <= int(settings.REDIS_URL.rstrip("/").rpartition("/")[2]) <= 15


@pytest.mark.django_db
def test_export_pages_visit_every_record_once_even_with_equal_times() -> None:
    from billing.selectors import usage_row_pages

    tenant = TenantFactory.create()
    same = "2026-11-05T10:00:00+00:00"
    records = [_record(tenant, started_at=same) for _ in range(5)]
    records += [_record(tenant, started_at=f"2026-11-05T10:00:0{i}+00:00") for i in range(1, 4)]
    usage_records_insert(records)
    pages = list(
        usage_row_pages(
            tenant=tenant,
            start=datetime(2026, 11, 5, tzinfo=UTC),
            end=datetime(2026, 11, 6, tzinfo=UTC),
            page_size=2,
        )
    )
    seen = [row[1] for page in pages for row in page]
    assert len(pages) == 4 and sorted(seen) == sorted(r.request_id for r in records)
    assert len(set(seen)) == len(seen)


@pytest.mark.django_db
def test_cache_hits_are_counted_in_the_rollups_and_are_not_problems() -> None:
    from django.db.models import Sum

    from billing.models import DailyUsage
    from dashboard.selectors import recent_problems

    tenant = TenantFactory.create()
    hit = _record(tenant, status="cache_hit", prompt_tokens=0, completion_tokens=0, replica="")
    insert_with_rollups([_record(tenant), hit, _record(tenant, status="error")])
    rows = DailyUsage.objects.filter(tenant=tenant)
    day = rows.aggregate(requests=Sum("requests"), errors=Sum("errors"), hits=Sum("cache_hits"))
    assert day == {"requests": 3, "errors": 1, "hits": 1}
    assert [r.status for r in recent_problems(tenant=tenant)] == ["error"]
