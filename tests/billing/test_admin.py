"""The billing pages of Django admin, as platform staff use them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.test import Client

from billing.invoicing import invoice_compute
from billing.models import Price
from billing.services import usage_records_insert
from fleet.models import Model
from tenants.models import AuditEvent
from tests.billing.test_usage import _record
from tests.factories import TenantFactory, UserFactory


@pytest.fixture
def staff_client(db: None) -> Client:
    user = UserFactory.create(username="ops", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize("page", ["price", "usagerecord", "dailyusage", "invoice"])
def test_billing_admin_pages_render(staff_client: Client, page: str) -> None:
    tenant = TenantFactory.create()
    usage_records_insert([_record(tenant, started_at="2026-10-05T10:00:00+00:00")])
    invoice = invoice_compute(tenant=tenant, period_start=datetime(2026, 10, 1, tzinfo=UTC).date())
    assert staff_client.get(f"/admin/billing/{page}/").status_code == 200
    if page == "invoice":
        assert staff_client.get(f"/admin/billing/invoice/{invoice.pk}/change/").status_code == 200


def test_prices_are_added_through_the_service_and_never_edited(staff_client: Client) -> None:
    model = Model.objects.create(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    response = staff_client.post(
        "/admin/billing/price/add/",
        {
            "model": model.pk,
            "input_per_mtok": "0.15",
            "cached_input_per_mtok": "0.075",
            "output_per_mtok": "0.6",
            "batch_discount_percent": "50",
            "effective_from_0": "2999-01-01",
            "effective_from_1": "00:00:00",
        },
    )
    assert response.status_code == 302, response.content[:2000]
    price = Price.objects.get()
    assert AuditEvent.objects.filter(action="price.set").count() == 1
    edit = staff_client.post(f"/admin/billing/price/{price.pk}/change/", {"input_per_mtok": "9"})
    assert edit.status_code == 403
    price.refresh_from_db()
    assert str(price.input_per_mtok) == "0.150000"
