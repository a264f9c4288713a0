"""Stripe: push finalized invoices, apply webhook events.

Every write to Stripe carries an idempotency key derived from our own ids, so a retried
task (a worker crash between Stripe's answer and our save) creates nothing twice: Stripe
replays the first answer. What Stripe created is saved step by step (customer, invoice, each
item), so a retry resumes where the last attempt stopped.

Webhooks are verified with the endpoint's signing secret, applied once per event id, and
tolerate reordering: a payment state carries the event's creation time, and an older event
never overwrites a newer one; ``paid`` and ``void`` are final.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from stripe import RequestOptions
from stripe.params import CustomerCreateParams

from billing.models import BillingAccount, Invoice, StripeEvent
from tenants.services import audit_record

log = logging.getLogger(__name__)

# Tests put a recording client here (the only fake: Stripe's servers cannot be reached).
http_client: stripe.HTTPClient | None = None


class StripeNotConfigured(Exception):
    pass


def stripe_client() -> stripe.StripeClient:
    if not settings.STRIPE_API_KEY:
        raise StripeNotConfigured("STRIPE_API_KEY is not set")
    return stripe.StripeClient(
        settings.STRIPE_API_KEY, http_client=http_client, max_network_retries=2
    )


def _idem(*parts: object) -> RequestOptions:
    return {"idempotency_key": "inferplane-" + "-".join(str(p) for p in parts)}


@transaction.atomic
def invoice_stripe_push(*, invoice_id: int) -> Invoice:
    """Create (or finish creating) the Stripe customer, invoice and items, and finalize it.

    Runs holding the invoice's row lock, so a void cannot slip in between our checks and
    Stripe's finalization (a void waits, then sees the Stripe invoice and voids it there).
    Should it crash midway, what it saved rolls back, and the retry replays the same
    idempotency keys: Stripe answers with what it already created.
    """
    invoice = Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice_id)
    if invoice.status not in (Invoice.Status.FINALIZED, Invoice.Status.PAID):
        return invoice
    if invoice.total_cents <= 0 or invoice.stripe_status in ("open", "paid", "void"):
        return invoice
    client = stripe_client()
    tenant = invoice.tenant
    account, _ = BillingAccount.objects.get_or_create(tenant=tenant)
    if not account.stripe_customer_id:
        params: CustomerCreateParams = {
            "name": tenant.name,
            "metadata": {"inferplane_tenant": tenant.slug, "inferplane_tenant_id": str(tenant.pk)},
        }
        if account.email:
            params["email"] = account.email
        customer = client.v1.customers.create(params=params, options=_idem("customer", tenant.pk))
        account.stripe_customer_id = customer.id
        account.save(update_fields=["stripe_customer_id"])
    period = f"{invoice.period_start:%Y-%m}"
    if not invoice.stripe_invoice_id:
        created = client.v1.invoices.create(
            params={
                "customer": account.stripe_customer_id,
                "currency": invoice.currency,
                "collection_method": "send_invoice",
                "days_until_due": settings.INVOICE_DAYS_UNTIL_DUE,
                "auto_advance": False,
                "pending_invoice_items_behavior": "exclude",
                "description": f"Inferplane usage, {period}",
                "metadata": {"inferplane_invoice_id": str(invoice.pk), "period": period},
            },
            options=_idem("invoice", invoice.pk),
        )
        invoice.stripe_invoice_id = created.id
        invoice.stripe_status = created.status or ""
        invoice.save(update_fields=["stripe_invoice_id", "stripe_status"])
    for line in invoice.lines.filter(amount_cents__gt=0, stripe_invoice_item_id=""):
        item = client.v1.invoice_items.create(
            params={
                "customer": account.stripe_customer_id,
                "invoice": invoice.stripe_invoice_id,
                "amount": line.amount_cents,
                "currency": invoice.currency,
                "description": line.description,
                "metadata": {"inferplane_invoice_line_id": str(line.pk)},
            },
            options=_idem("invoice", invoice.pk, "line", line.pk),
        )
        line.stripe_invoice_item_id = item.id
        line.save(update_fields=["stripe_invoice_item_id"])
    finalized = client.v1.invoices.finalize_invoice(
        invoice.stripe_invoice_id, options=_idem("invoice", invoice.pk, "finalize")
    )
    invoice.stripe_status = finalized.status or ""
    invoice.stripe_hosted_url = finalized.hosted_invoice_url or ""
    invoice.save(update_fields=["stripe_status", "stripe_hosted_url"])
    return invoice


def invoice_stripe_void(*, invoice_id: int) -> Invoice:
    invoice = Invoice.objects.get(pk=invoice_id)
    if invoice.stripe_invoice_id and invoice.stripe_status != "void":
        voided = stripe_client().v1.invoices.void_invoice(
            invoice.stripe_invoice_id, options=_idem("invoice", invoice.pk, "void")
        )
        invoice.stripe_status = voided.status or "void"
        invoice.save(update_fields=["stripe_status"])
    return invoice


# --- Webhooks ----------------------------------------------------------------------------------


class WebhookRejected(Exception):
    """The call is not a genuine Stripe event (bad or missing signature, bad payload)."""


def stripe_event_verify(*, payload: bytes, signature: str) -> stripe.Event:
    if not settings.STRIPE_WEBHOOK_SECRET:
        raise WebhookRejected("Stripe webhooks are not configured (STRIPE_WEBHOOK_SECRET).")
    try:
        event: stripe.Event = stripe.Webhook.construct_event(
            payload, signature, settings.STRIPE_WEBHOOK_SECRET
        )
        return event
    except stripe.SignatureVerificationError:
        raise WebhookRejected("The Stripe-Signature header does not match.") from None
    except ValueError:
        raise WebhookRejected("The payload is not a Stripe event.") from None


class EventDeferred(Exception):
    """The event cannot be applied right now (Stripe could not be asked about it): not
    recorded, so the webhook answers non-2xx and Stripe delivers it again later."""


def _locked(**lookup: str) -> Invoice | None:
    return Invoice.objects.select_for_update().filter(**lookup).first()


def _newer(invoice: Invoice, at: datetime) -> bool:
    return invoice.stripe_state_at is None or at >= invoice.stripe_state_at


def stripe_event_apply(*, event: stripe.Event) -> str:
    """Apply one verified event, once. Returns what happened (for the log and the answer);
    raises ``EventDeferred`` when it must come again later."""
    created = datetime.fromtimestamp(event.created, tz=UTC)
    obj: dict[str, Any] = event.data.object.to_dict()
    with transaction.atomic():
        try:
            with transaction.atomic():
                StripeEvent.objects.create(event_id=event.id, type=event.type, created=created)
        except IntegrityError:
            return "duplicate"
        if event.type in ("invoice.paid", "invoice.payment_failed"):
            invoice = _locked(stripe_invoice_id=obj.get("id") or "-")
            if invoice is None:
                return "ignored: not an Inferplane invoice"
            if event.type == "invoice.paid":
                return _paid(invoice, obj, created)
            return _payment_failed(invoice, obj, created)
        if event.type == "charge.refunded":
            invoice = _invoice_for_payment(
                payment_intent=obj.get("payment_intent"), charge=obj.get("id")
            )
            if invoice is None:
                return "ignored: not an Inferplane payment"
            return _refunded(invoice, obj)
        if event.type in ("charge.dispute.created", "charge.dispute.closed"):
            charge = obj.get("charge")
            invoice = _invoice_for_payment(
                payment_intent=obj.get("payment_intent"),
                charge=charge.get("id") if isinstance(charge, dict) else charge,
            )
            if invoice is None:
                return "ignored: not an Inferplane payment"
            return _dispute(invoice, obj, created, opened=event.type.endswith("created"))
    return "ignored: event type not used"


def _expandable_id(value: Any) -> str:
    return str((value.get("id") if isinstance(value, dict) else value) or "")


def _invoice_for_payment(*, payment_intent: Any, charge: Any) -> Invoice | None:
    """Our invoice that a charge or payment intent paid. Refund and dispute events name only
    the payment; since API version 2025-03-31 invoices name their payments only through
    Stripe's InvoicePayment objects, so an unknown payment is looked up there once and then
    remembered. ``EventDeferred`` when Stripe cannot be asked right now."""
    pi, ch = _expandable_id(payment_intent), _expandable_id(charge)
    for field, value in (("stripe_payment_intent_id", pi), ("stripe_charge_id", ch)):
        if value and (found := _locked(**{field: value})):
            return found
    if not (pi or ch):
        return None
    try:
        params: Any = (
            {"payment": {"type": "payment_intent", "payment_intent": pi}}
            if pi
            else {"payment": {"type": "charge", "charge": ch}}
        )
        payments = stripe_client().v1.invoice_payments.list(params=params)
    except StripeNotConfigured:
        return None
    except stripe.StripeError as exc:
        raise EventDeferred(f"could not ask Stripe about payment {pi or ch}: {exc}") from exc
    for payment in payments.data:
        invoice = _locked(stripe_invoice_id=_expandable_id(payment.invoice) or "-")
        if invoice is not None:
            invoice.stripe_payment_intent_id = invoice.stripe_payment_intent_id or pi
            invoice.stripe_charge_id = invoice.stripe_charge_id or ch
            invoice.save(update_fields=["stripe_payment_intent_id", "stripe_charge_id"])
            return invoice
    return None


def _paid(invoice: Invoice, obj: Any, at: datetime) -> str:
    # Paid is final: an older payment_failed arriving after it changes nothing.
    if invoice.status not in (Invoice.Status.FINALIZED, Invoice.Status.DRAFT):
        return f"ignored: invoice is {invoice.status}"
    invoice.status = Invoice.Status.PAID
    invoice.paid_at = at
    invoice.stripe_status = "paid"
    invoice.stripe_state_at = at
    # Older API versions name the payment on the invoice; newer ones list it in `payments`
    # (when included). Either way it is remembered for refunds and disputes.
    invoice.stripe_charge_id = _expandable_id(obj.get("charge")) or invoice.stripe_charge_id
    invoice.stripe_payment_intent_id = (
        _expandable_id(obj.get("payment_intent")) or invoice.stripe_payment_intent_id
    )
    for entry in (obj.get("payments") or {}).get("data") or ():
        payment = entry.get("payment") or {}
        invoice.stripe_payment_intent_id = invoice.stripe_payment_intent_id or _expandable_id(
            payment.get("payment_intent")
        )
        invoice.stripe_charge_id = invoice.stripe_charge_id or _expandable_id(payment.get("charge"))
    invoice.save()
    audit_record(actor=None, tenant=invoice.tenant, action="invoice.paid", target=invoice)
    return "paid"


def _payment_failed(invoice: Invoice, obj: Any, at: datetime) -> str:
    if invoice.status != Invoice.Status.FINALIZED or not _newer(invoice, at):
        return "ignored: stale or final"
    invoice.payment_failed_at = at
    invoice.stripe_state_at = at
    invoice.save(update_fields=["payment_failed_at", "stripe_state_at"])
    audit_record(
        actor=None,
        tenant=invoice.tenant,
        action="invoice.payment_failed",
        target=invoice,
        details={"attempt_count": obj.get("attempt_count")},
    )
    return "payment failed"


def _refunded(invoice: Invoice, obj: Any) -> str:
    # amount_refunded is cumulative: the largest seen wins, whatever the order of delivery.
    refunded = int(obj.get("amount_refunded") or 0)
    if refunded <= invoice.refunded_cents:
        return "ignored: an older refund total"
    invoice.refunded_cents = refunded
    invoice.save(update_fields=["refunded_cents"])
    audit_record(
        actor=None,
        tenant=invoice.tenant,
        action="invoice.refunded",
        target=invoice,
        details={"refunded_cents": refunded},
    )
    return "refund recorded"


def _dispute(invoice: Invoice, obj: Any, at: datetime, *, opened: bool) -> str:
    lost = obj.get("status") == "lost"
    disputed = opened or lost
    # A dispute's close is newer than its opening; an opening delivered late stays history.
    if not opened or _newer(invoice, at):
        invoice.disputed = disputed
        invoice.stripe_state_at = max(at, invoice.stripe_state_at or at)
        invoice.save(update_fields=["disputed", "stripe_state_at"])
    audit_record(
        actor=None,
        tenant=invoice.tenant,
        action="invoice.dispute_opened" if opened else "invoice.dispute_closed",
        target=invoice,
        details={"status": obj.get("status"), "reason": obj.get("reason")},
    )
    return "dispute recorded"
