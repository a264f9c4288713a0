"""The usage and costs APIs as tenant members, finance, operators and outsiders use them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from rest_framework.test import APIClient

from billing.models import Price
from billing.services import daily_usage_refresh_stale, usage_records_insert
from fleet.models import Model
from tests.billing.test_usage import _record
from tests.conftest import TenantPeople, client_for

PERSONAS = ["owner", "admin", "developer", "finance", "viewer", "outsider", "staff"]
DAY1 = datetime(2026, 11, 10, 9, tzinfo=UTC)
START = int(datetime(2026, 11, 10, tzinfo=UTC).timestamp())
END = int(datetime(2026, 11, 13, tzinfo=UTC).timestamp())  # three days: 10, 11, 12


@pytest.fixture
def ledger(people: TenantPeople, django_capture_on_commit_callbacks: Any) -> TenantPeople:
    model = Model.objects.create(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    Price.objects.create(
        model=model,
        input_per_mtok=Decimal("0.15"),
        cached_input_per_mtok=Decimal("0.075"),
        output_per_mtok=Decimal("0.60"),
        batch_discount_percent=Decimal(50),
        effective_from=DAY1 - timedelta(days=30),
    )
    records = [
        _record(
            people.tenant, started_at=DAY1.isoformat(), prompt_tokens=1000, completion_tokens=100
        ),
        _record(
            people.tenant,
            started_at=DAY1.isoformat(),
            prompt_tokens=1000,
            completion_tokens=100,
            mode="batch",
            priority="background",  # as every batch line
        ),
        _record(
            people.tenant,
            started_at=(DAY1 + timedelta(days=2)).isoformat(),
            prompt_tokens=10,
            completion_tokens=5,
            cached_tokens=4,
        ),
        # Another tenant's usage on the same days: never in acme's answers.
        _record(people.other_tenant, started_at=DAY1.isoformat(), prompt_tokens=777),
    ]
    with django_capture_on_commit_callbacks(execute=True):
        usage_records_insert(records)
    daily_usage_refresh_stale()
    return people


def _get(client: APIClient, path: str, **params: Any) -> Any:
    return client.get(f"/api/{path}/", {"start_time": START, "end_time": END, **params})


@pytest.mark.parametrize(
    ("persona", "status"), list(zip(PERSONAS, [200, 200, 403, 200, 403, 404, 200], strict=True))
)
@pytest.mark.parametrize("path", ["usage", "costs"])
def test_who_sees_a_tenants_usage_and_costs(
    ledger: TenantPeople, path: str, persona: str, status: int
) -> None:
    response = _get(client_for(ledger.user(persona)), path, tenant="acme")
    assert response.status_code == status, response.content
    if status == 404:
        assert b"acme" not in response.content.lower()


def test_usage_by_day_and_model(ledger: TenantPeople) -> None:
    body = _get(client_for(ledger.finance), "usage", tenant="acme", group_by="model").json()
    assert body["object"] == "page" and body["has_more"] is False
    assert [b["start_time"] for b in body["data"]] == [START, START + 86400, START + 2 * 86400]
    first, second, third = (b["results"] for b in body["data"])
    assert first == [
        {
            "object": "organization.usage.completions.result",
            "input_tokens": 2000,
            "output_tokens": 200,
            "input_cached_tokens": 0,
            "num_model_requests": 2,
            "num_errors": 0,
            "num_cache_hits": 0,
            "model": "tiny-chat",
            "api_key_id": None,
            "batch": None,
            "adapter": None,
            "priority": None,
        }
    ]
    assert second == []  # a day without usage is an empty bucket, not a missing one
    assert third[0]["input_cached_tokens"] == 4


def test_usage_by_priority_class(ledger: TenantPeople) -> None:
    """The rollups keep the class each request ran in (a class may carry its own price)."""
    body = _get(client_for(ledger.finance), "usage", tenant="acme", group_by="priority").json()
    first = body["data"][0]["results"]
    assert {r["priority"]: r["num_model_requests"] for r in first} == {
        "standard": 1,
        "background": 1,
    }
    assert {r["model"] for r in first} == {None}


def test_usage_by_key_and_mode(ledger: TenantPeople) -> None:
    body = _get(client_for(ledger.owner), "usage", tenant="acme", group_by="api_key,mode").json()
    results = body["data"][0]["results"]
    assert sorted(r["batch"] for r in results) == [False, True]
    assert all(r["api_key_id"].startswith("sk-ip-") for r in results)


def test_costs_are_exact_decimal_strings(ledger: TenantPeople) -> None:
    body = _get(client_for(ledger.finance), "costs", tenant="acme", group_by="line_item").json()
    results = {r["line_item"]: r["amount"] for r in body["data"][0]["results"]}
    # 1000 x 0.15 + 100 x 0.60 = 210 micro-dollars online; half that in batch.
    assert results == {
        "tiny-chat, batch": {"value": "0.000105", "currency": "usd"},
        "tiny-chat, online": {"value": "0.000210", "currency": "usd"},
    }
    total = _get(client_for(ledger.finance), "costs", tenant="acme").json()
    assert total["data"][0]["results"][0]["amount"]["value"] == "0.000315"


def test_staff_see_every_tenant_without_naming_one(ledger: TenantPeople) -> None:
    body = _get(client_for(ledger.staff), "usage").json()
    assert body["data"][0]["results"][0]["input_tokens"] == 2000 + 777
    response = _get(client_for(ledger.finance), "usage")
    assert response.status_code == 400 and "tenant" in response.json()


def test_pages_of_buckets(ledger: TenantPeople) -> None:
    client = client_for(ledger.finance)
    first = _get(client, "usage", tenant="acme", limit=2).json()
    assert len(first["data"]) == 2 and first["has_more"] is True
    rest = _get(client, "usage", tenant="acme", limit=2, page=first["next_page"]).json()
    assert [b["start_time"] for b in rest["data"]] == [START + 2 * 86400]
    assert rest["has_more"] is False and rest["next_page"] is None


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"start_time": "yesterday"}, "start_time"),
        ({"bucket_width": "1h"}, "bucket_width"),
        ({"group_by": "colour"}, "group_by"),
        ({"limit": 500}, "limit"),
        ({"end_time": START - 1}, "end_time"),
    ],
)
def test_bad_queries_get_drf_errors(
    ledger: TenantPeople, params: dict[str, Any], field: str
) -> None:
    response = _get(client_for(ledger.finance), "usage", tenant="acme", **params)
    assert response.status_code == 400 and field in response.json()


def test_anonymous_is_refused(ledger: TenantPeople) -> None:
    assert _get(APIClient(), "usage", tenant="acme").status_code in (401, 403)
