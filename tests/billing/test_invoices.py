"""Invoices: the rounding rule, idempotent finalization, the exact requests sent to Stripe,
signed webhooks delivered twice and out of order, and who may see what."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.utils import timezone

from billing import stripe_sync
from billing.invoicing import invoice_compute, invoice_finalize, micros_to_cents
from billing.models import BillingAccount, Invoice, StripeEvent, UsageRecord
from billing.services import usage_records_insert
from billing.stripe_sync import invoice_stripe_push, invoice_stripe_void
from tenants.models import AuditEvent, Tenant
from tests.billing.stripe_fake import RecordedStripe, event, signed
from tests.billing.test_usage import _record
from tests.conftest import TenantPeople, client_for, run_manage, streamed

OCT = date(2026, 10, 1)
IN_OCT = datetime(2026, 10, 15, 12, tzinfo=UTC)
SECRET = "whsec_test_4eC39HqLyjWDarjtT1zdp7dc"


@pytest.fixture
def stripe_http(settings: Any) -> Iterator[RecordedStripe]:
    settings.STRIPE_API_KEY = "sk_test_inferplane"
    settings.STRIPE_WEBHOOK_SECRET = SECRET
    recorded = RecordedStripe()
    stripe_sync.http_client = recorded
    yield recorded
    stripe_sync.http_client = None


def _usage(tenant: Tenant, *costs_by_item: tuple[str, str, int], at: datetime = IN_OCT) -> None:
    usage_records_insert(
        [
            _record(tenant, model=model, mode=mode, cost_micros=cost, started_at=at.isoformat())
            for model, mode, cost in costs_by_item
        ]
    )


# --- Rounding and computing ------------------------------------------------------------------


def test_rounding_rule() -> None:
    assert [micros_to_cents(m) for m in (0, 4_999, 5_000, 12_345, 15_000, 1_234_567)] == [
        0,
        0,
        1,
        1,
        2,
        123,
    ]


@pytest.mark.django_db
def test_lines_per_model_and_mode_and_the_total_is_their_sum() -> None:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    _usage(
        tenant,
        ("big", "online", 7_000),
        ("big", "online", 5_345),  # line: 12,345 micro-dollars -> 1 cent
        ("big", "batch", 15_000),  # -> 2 cents (half up)
        ("small", "online", 4_999),  # -> 0 cents
        ("small", "online", 0),
    )
    _usage(tenant, ("big", "online", 10**9), at=IN_OCT + timedelta(days=30))  # November
    invoice = invoice_compute(tenant=tenant, period_start=OCT)
    lines = {(line.model, line.mode): line for line in invoice.lines.all()}
    assert {k: v.amount_cents for k, v in lines.items()} == {
        ("big", "batch"): 2,
        ("big", "online"): 1,
        ("small", "online"): 0,
    }
    assert lines[("big", "online")].requests == 2
    assert invoice.total_cents == 3 == sum(line.amount_cents for line in lines.values())
    assert invoice.cost_micros == 32_344


@pytest.mark.django_db
def test_a_month_cannot_be_finalized_before_it_ends() -> None:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    with pytest.raises(ValidationError, match="not over yet"):
        invoice_finalize(
            tenant=tenant, period_start=timezone.now().date().replace(day=1), actor=None
        )
    with pytest.raises(ValidationError, match="first day"):
        invoice_compute(tenant=tenant, period_start=date(2026, 10, 2))


# --- Finalization and Stripe -----------------------------------------------------------------


@pytest.mark.django_db
def test_finalizing_twice_makes_one_invoice_and_one_stripe_invoice(
    stripe_http: RecordedStripe, django_capture_on_commit_callbacks: Any
) -> None:
    tenant = Tenant.objects.create(slug="acme", name="Acme Corp")
    _usage(tenant, ("big", "online", 1_234_567), ("big", "batch", 25_000))
    with django_capture_on_commit_callbacks() as pushes:
        first = invoice_finalize(tenant=tenant, period_start=OCT, actor=None)
    assert first.status == "finalized" and first.total_cents == 123 + 3
    assert len(pushes) == 1  # the Stripe push is queued once, after commit
    invoice_stripe_push(invoice_id=first.pk)

    with django_capture_on_commit_callbacks() as again:
        second = invoice_finalize(tenant=tenant, period_start=OCT, actor=None)
    assert second.pk == first.pk and not again
    invoice_stripe_push(invoice_id=first.pk)  # a duplicate task run sends nothing
    assert Invoice.objects.count() == 1

    calls = [(c.method, c.path) for c in stripe_http.calls]
    stripe_id = Invoice.objects.get().stripe_invoice_id
    assert calls == [
        ("POST", "/v1/customers"),
        ("POST", "/v1/invoices"),
        ("POST", "/v1/invoiceitems"),
        ("POST", "/v1/invoiceitems"),
        ("POST", f"/v1/invoices/{stripe_id}/finalize"),
    ]
    customer, created, batch, online, _ = stripe_http.calls
    assert customer.params["name"] == "Acme Corp"
    assert customer.params["metadata[inferplane_tenant]"] == "acme"
    assert created.params["currency"] == "usd"
    assert created.params["collection_method"] == "send_invoice"
    assert created.params["customer"] == customer_id(stripe_http)
    assert (batch.params["amount"], online.params["amount"]) == ("3", "123")
    assert {batch.params["currency"], online.params["currency"]} == {"usd"}
    assert {batch.params["invoice"], online.params["invoice"]} == {stripe_id}
    lines = {line.mode: line.pk for line in first.lines.all()}
    assert [c.idempotency_key for c in stripe_http.calls] == [
        f"inferplane-customer-{tenant.pk}",
        f"inferplane-invoice-{first.pk}",
        f"inferplane-invoice-{first.pk}-line-{lines['batch']}",
        f"inferplane-invoice-{first.pk}-line-{lines['online']}",
        f"inferplane-invoice-{first.pk}-finalize",
    ]
    final = Invoice.objects.get()
    assert final.stripe_status == "open" and final.stripe_hosted_url.startswith("https://")


def customer_id(recorded: RecordedStripe) -> str:
    return BillingAccount.objects.get(tenant__slug="acme").stripe_customer_id


@pytest.mark.django_db
def test_a_push_that_crashed_midway_resumes_without_duplicates(
    stripe_http: RecordedStripe,
) -> None:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    _usage(tenant, ("big", "online", 1_000_000), ("big", "batch", 2_000_000))
    invoice = invoice_finalize(tenant=tenant, period_start=OCT, actor=None)
    stripe_http.fail_on = "/v1/invoiceitems"
    with pytest.raises(Exception, match="recorded failure"):
        invoice_stripe_push(invoice_id=invoice.pk)
    invoice_stripe_push(invoice_id=invoice.pk)  # the task's retry
    # The retry replayed the same idempotency keys: Stripe created each object once.
    kinds = [object_id.split("_")[0] for object_id in stripe_http.created]
    assert sorted(kinds) == ["cus", "ii", "ii", "in"]
    amounts = sorted(c.params["amount"] for c in stripe_http.calls if c.path == "/v1/invoiceitems")
    assert set(amounts) == {"100", "200"}
    assert Invoice.objects.get().stripe_status == "open"


@pytest.mark.django_db
def test_without_a_stripe_key_finalizing_still_works(settings: Any) -> None:
    settings.STRIPE_API_KEY = ""
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    _usage(tenant, ("big", "online", 1_000_000))
    invoice = invoice_finalize(tenant=tenant, period_start=OCT, actor=None)
    with pytest.raises(stripe_sync.StripeNotConfigured):
        invoice_stripe_push(invoice_id=invoice.pk)
    assert Invoice.objects.get().status == "finalized"


# --- Webhooks --------------------------------------------------------------------------------


@pytest.fixture
def sent_invoice(stripe_http: RecordedStripe) -> Invoice:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    _usage(tenant, ("big", "online", 5_000_000))
    invoice = invoice_finalize(tenant=tenant, period_start=OCT, actor=None)
    return invoice_stripe_push(invoice_id=invoice.pk)


def _deliver(payload: dict[str, Any], secret: str = SECRET) -> Any:
    body, signature = signed(payload, secret)
    return Client().post(
        "/api/stripe/webhook/",
        body,
        content_type="application/json",
        headers={"stripe-signature": signature},
    )


def _paid(invoice: Invoice, event_id: str, created: int) -> dict[str, Any]:
    # As the current API version sends it: the invoice names no charge or payment intent.
    obj = {
        "id": invoice.stripe_invoice_id,
        "object": "invoice",
        "status": "paid",
        "amount_paid": invoice.total_cents,
    }
    return event(event_id, "invoice.paid", obj, created=created)


def _failed(invoice: Invoice, event_id: str, created: int) -> dict[str, Any]:
    obj = {
        "id": invoice.stripe_invoice_id,
        "object": "invoice",
        "status": "open",
        "attempt_count": 1,
    }
    return event(event_id, "invoice.payment_failed", obj, created=created)


@pytest.mark.django_db
def test_a_forged_or_unsigned_webhook_changes_nothing(sent_invoice: Invoice) -> None:
    response = _deliver(_paid(sent_invoice, "evt_1", 1_800_000_000), secret="whsec_wrong")
    assert response.status_code == 400 and "Stripe-Signature" in response.json()["error"]
    unsigned = Client().post("/api/stripe/webhook/", b"{}", content_type="application/json")
    assert unsigned.status_code == 400
    assert Client().get("/api/stripe/webhook/").status_code == 405
    assert Invoice.objects.get().status == "finalized" and not StripeEvent.objects.exists()


@pytest.mark.django_db
def test_paid_once_whatever_is_delivered_twice_or_late(sent_invoice: Invoice) -> None:
    t = 1_800_000_000
    assert _deliver(_paid(sent_invoice, "evt_paid", t)).json()["outcome"] == "paid"
    assert _deliver(_paid(sent_invoice, "evt_paid", t)).json()["outcome"] == "duplicate"
    # An older failed attempt delivered after the payment does not undo it.
    late = _deliver(_failed(sent_invoice, "evt_failed", t - 3600)).json()["outcome"]
    assert late.startswith("ignored")
    invoice = Invoice.objects.get()
    assert invoice.status == "paid" and invoice.payment_failed_at is None
    assert AuditEvent.objects.filter(action="invoice.paid").count() == 1


@pytest.mark.django_db
def test_a_failed_payment_then_a_later_success(sent_invoice: Invoice) -> None:
    t = 1_800_000_000
    assert _deliver(_failed(sent_invoice, "evt_f", t)).json()["outcome"] == "payment failed"
    assert Invoice.objects.get().payment_failed_at is not None
    _deliver(_paid(sent_invoice, "evt_p", t + 86400))
    assert Invoice.objects.get().status == "paid"


@pytest.mark.django_db
def test_refunds_and_disputes_in_any_order(
    sent_invoice: Invoice, stripe_http: RecordedStripe
) -> None:
    t = 1_800_000_000
    pi = stripe_http.payment_intents[sent_invoice.stripe_invoice_id]
    charge = {"id": "ch_Test1", "object": "charge", "payment_intent": pi}
    dispute = {
        "id": "dp_1",
        "object": "dispute",
        "charge": "ch_Test1",
        "payment_intent": pi,
        "status": "needs_response",
        "reason": "fraudulent",
    }
    # A dispute that overtook the payment: Stripe is asked which invoice the payment paid.
    stripe_http.fail_on = "/v1/invoice_payments"  # ... and cannot answer right now
    early = _deliver(event("evt_d", "charge.dispute.created", dispute, created=t + 10))
    assert early.status_code == 409 and not StripeEvent.objects.filter(event_id="evt_d").exists()
    again = _deliver(event("evt_d", "charge.dispute.created", dispute, created=t + 10))
    assert again.status_code == 200 and again.json()["outcome"] == "dispute recorded"
    assert Invoice.objects.get().disputed is True
    _deliver(_paid(sent_invoice, "evt_p", t))
    # Cumulative refund totals delivered out of order: the larger one stands.
    _deliver(event("evt_r2", "charge.refunded", {**charge, "amount_refunded": 500}, created=t + 30))
    _deliver(event("evt_r1", "charge.refunded", {**charge, "amount_refunded": 200}, created=t + 20))
    # The dispute is won; its opening redelivered late changes nothing.
    won = {**dispute, "status": "won"}
    _deliver(event("evt_dc", "charge.dispute.closed", won, created=t + 40))
    _deliver(event("evt_d0", "charge.dispute.created", dispute, created=t + 10))
    invoice = Invoice.objects.get()
    assert invoice.refunded_cents == 500 and invoice.disputed is False
    assert (invoice.status, invoice.stripe_payment_intent_id) == ("paid", pi)
    lookups = [c for c in stripe_http.calls if c.path == "/v1/invoice_payments"]
    assert len(lookups) == 2  # the failed try and one answer; then the payment is known


@pytest.mark.django_db
def test_payments_that_are_not_ours_are_acknowledged(sent_invoice: Invoice) -> None:
    refund = {
        "id": "ch_other",
        "object": "charge",
        "payment_intent": "pi_other",
        "amount_refunded": 9,
    }
    response = _deliver(event("evt_x", "charge.refunded", refund, created=1_800_000_000))
    assert response.status_code == 200 and response.json()["outcome"].startswith("ignored")
    assert Invoice.objects.get().refunded_cents == 0


# --- The API ---------------------------------------------------------------------------------


@pytest.fixture
def billed(people: TenantPeople) -> Invoice:
    _usage(people.tenant, ("big", "online", 1_234_567), ("big", "batch", 25_000))
    _usage(people.other_tenant, ("big", "online", 999_999))
    return invoice_compute(tenant=people.tenant, period_start=OCT)


PERSONAS = ["owner", "admin", "developer", "finance", "viewer", "outsider", "staff"]
READ = [200, 200, 403, 200, 403, 404, 200]


@pytest.mark.parametrize(("persona", "status"), list(zip(PERSONAS, READ, strict=True)))
@pytest.mark.parametrize("what", ["list", "detail", "lines", "usage"])
def test_who_sees_invoices_and_exports(
    people: TenantPeople, billed: Invoice, what: str, persona: str, status: int
) -> None:
    url = {
        "list": "/api/tenants/acme/invoices/",
        "detail": f"/api/tenants/acme/invoices/{billed.pk}/",
        "lines": f"/api/tenants/acme/invoices/{billed.pk}/lines.csv",
        "usage": "/api/tenants/acme/usage.csv?start=2026-10-01&end=2026-10-31",
    }[what]
    response = client_for(people.user(persona)).get(url)
    assert response.status_code == status
    if status == 404:
        assert b"acme" not in b"".join(getattr(response, "streaming_content", [response.content]))


def test_an_outsider_cannot_reach_an_invoice_through_their_own_tenant(
    people: TenantPeople, billed: Invoice
) -> None:
    client = client_for(people.outsider)
    assert client.get(f"/api/tenants/globex/invoices/{billed.pk}/").status_code == 404
    assert client.get(f"/api/tenants/globex/invoices/{billed.pk}/lines.csv").status_code == 404


@pytest.mark.parametrize(("persona", "status"), [("finance", 403), ("owner", 403), ("staff", 200)])
def test_only_operators_finalize(
    people: TenantPeople, billed: Invoice, persona: str, status: int
) -> None:
    response = client_for(people.user(persona)).post(
        "/api/tenants/acme/invoices/finalize/", {"period": "2026-10"}, format="json"
    )
    assert response.status_code == status
    if status == 200:
        assert response.json()["status"] == "finalized" and response.json()["total_cents"] == 126


def test_finalize_bad_input(people: TenantPeople) -> None:
    client = client_for(people.staff)
    bad = client.post("/api/tenants/acme/invoices/finalize/", {"period": "2026-13"}, format="json")
    assert bad.status_code == 400 and "period" in bad.json()
    now = timezone.now()
    early = client.post(
        "/api/tenants/acme/invoices/finalize/", {"period": f"{now:%Y-%m}"}, format="json"
    )
    assert early.status_code == 400 and "not over yet" in str(early.json())


def test_invoice_detail_and_lines_csv(people: TenantPeople, billed: Invoice) -> None:
    client = client_for(people.finance)
    detail = client.get(f"/api/tenants/acme/invoices/{billed.pk}/").json()
    assert detail["period"] == "2026-10" and detail["total_cents"] == 126
    assert sorted((line["mode"], line["amount_cents"]) for line in detail["lines"]) == [
        ("batch", 3),
        ("online", 123),
    ]
    response = client.get(f"/api/tenants/acme/invoices/{billed.pk}/lines.csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert response["content-type"] == "text/csv"
    assert sorted(r["amount_usd"] for r in rows) == ["0.03", "1.23"]


def test_usage_csv_matches_the_ledger(people: TenantPeople, billed: Invoice) -> None:
    response = client_for(people.finance).get(
        "/api/tenants/acme/usage.csv?start=2026-10-01&end=2026-10-31"
    )
    body = streamed(response).decode()
    rows = list(csv.DictReader(io.StringIO(body)))
    ledger = UsageRecord.objects.filter(tenant=people.tenant)
    assert sorted(r["request_id"] for r in rows) == sorted(r.request_id for r in ledger)
    assert {r["cost_usd"] for r in rows} == {"1.234567", "0.025000"}
    bad = client_for(people.finance).get(
        "/api/tenants/acme/usage.csv?start=2026-10-31&end=2026-10-01"
    )
    assert bad.status_code == 400


@pytest.mark.django_db(transaction=True)
def test_finalize_invoices_command() -> None:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    _usage(tenant, ("big", "online", 1_234_567))
    ok = run_manage("finalize_invoices", "--month", "2026-10", "--tenant", "acme")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "acme 2026-10: finalized, 1.23 USD"
    again = run_manage("finalize_invoices", "--month", "2026-10")
    assert again.returncode == 0 and Invoice.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--month", "October"], "--month must look like"),
        (["--month", "2026-13"], "--month must look like"),
        (["--month", "2026-10", "--tenant", "nope"], "no tenant"),
        (["--month", "2999-01"], "not over yet"),
        (["--month", "9999-12"], "--month must look like"),
    ],
)
def test_finalize_invoices_bad_input(args: list[str], message: str) -> None:
    Tenant.objects.create(slug="acme", name="Acme")
    result = run_manage("finalize_invoices", *args)
    assert result.returncode != 0
    assert result.stderr.strip().startswith("CommandError:") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.django_db
def test_an_invoice_spanning_a_price_change_charges_each_record_its_own_price() -> None:
    from decimal import Decimal

    from billing.models import Price
    from fleet.models import Model

    model = Model.objects.create(name="big", served_name="big", context_length=1024)
    for start, rate in ((datetime(2026, 9, 1, tzinfo=UTC), "1"), (IN_OCT, "3")):
        Price.objects.create(
            model=model,
            input_per_mtok=Decimal(rate),
            cached_input_per_mtok=Decimal(rate),
            output_per_mtok=Decimal(rate),
            effective_from=start,
        )
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    usage_records_insert(
        [
            _record(
                tenant,
                model="big",
                prompt_tokens=10_000,
                completion_tokens=0,
                started_at=(IN_OCT - timedelta(hours=1)).isoformat(),
            ),
            _record(
                tenant,
                model="big",
                prompt_tokens=10_000,
                completion_tokens=0,
                started_at=IN_OCT.isoformat(),
            ),
        ]
    )
    invoice = invoice_compute(tenant=tenant, period_start=OCT)
    # 10,000 tokens at $1/1M + 10,000 at $3/1M = 40,000 micro-dollars = 4 cents.
    assert (invoice.cost_micros, invoice.total_cents) == (40_000, 4)


def test_void_a_finalized_invoice_and_its_stripe_copy(
    people: TenantPeople, stripe_http: RecordedStripe, django_capture_on_commit_callbacks: Any
) -> None:
    _usage(people.tenant, ("big", "online", 5_000_000))
    staff = client_for(people.staff)
    draft = invoice_compute(tenant=people.tenant, period_start=OCT)
    refused = staff.post(f"/api/tenants/acme/invoices/{draft.pk}/void/")
    assert refused.status_code == 400 and "draft" in str(refused.json())
    invoice = invoice_finalize(tenant=people.tenant, period_start=OCT, actor=None)
    invoice_stripe_push(invoice_id=invoice.pk)
    for persona in ("finance", "owner"):
        denied = client_for(people.user(persona)).post(
            f"/api/tenants/acme/invoices/{invoice.pk}/void/"
        )
        assert denied.status_code == 403
    with django_capture_on_commit_callbacks() as queued:
        voided = staff.post(f"/api/tenants/acme/invoices/{invoice.pk}/void/")
    assert voided.status_code == 200 and voided.json()["status"] == "void"
    assert len(queued) == 1  # the Stripe void task, after commit
    invoice_stripe_void(invoice_id=invoice.pk)  # what that task runs
    void_calls = [c for c in stripe_http.calls if c.path.endswith("/void")]
    assert [c.idempotency_key for c in void_calls] == [f"inferplane-invoice-{invoice.pk}-void"]
    assert Invoice.objects.get().stripe_status == "void"
    # Void is final: finalizing the month again changes nothing.
    assert invoice_finalize(tenant=people.tenant, period_start=OCT, actor=None).status == "void"


def test_outsiders_cannot_finalize_or_void(people: TenantPeople, billed: Invoice) -> None:
    client = client_for(people.outsider)
    finalize = client.post(
        "/api/tenants/acme/invoices/finalize/", {"period": "2026-10"}, format="json"
    )
    assert finalize.status_code == 404
    assert client.post(f"/api/tenants/acme/invoices/{billed.pk}/void/").status_code == 404
    # Through their own tenant: refused before any lookup (voiding is for operators only).
    assert client.post(f"/api/tenants/globex/invoices/{billed.pk}/void/").status_code == 403
    assert Invoice.objects.get(pk=billed.pk).status == "draft"


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("invoices/finalize/", {"period": "0000-01"}),
        ("invoices/finalize/", {"period": "9999-12"}),
        ("usage.csv", {"start": "2026-10-01", "end": "9999-12-31"}),
    ],
)
def test_extreme_dates_get_400_not_500(
    people: TenantPeople, path: str, params: dict[str, str]
) -> None:
    client = client_for(people.staff)
    url = f"/api/tenants/acme/{path}"
    response = (
        client.post(url, params, format="json") if "finalize" in path else client.get(url, params)
    )
    assert response.status_code == 400
