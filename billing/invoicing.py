"""Invoices: one per tenant and calendar month (UTC), computed from the ledger.

Rounding rule (tested): a line is one model and mode; its amount in cents is the sum of its
records' costs in micro-dollars, rounded once, half up (5,000 micro-dollars round up to a
cent). The invoice total is the sum of its line amounts, so the lines always add up.

Life: draft (recomputed on demand) → finalized (frozen; pushed to Stripe) → paid | void.
Finalizing is idempotent: a second call returns the same invoice and changes nothing.
"""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, time

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from billing.models import Invoice, InvoiceLine, UsageRecord
from billing.selectors import ledger_sums
from billing.signals import invoice_finalized, invoice_voided
from tenants.models import Tenant, User
from tenants.services import audit_record

log = logging.getLogger(__name__)

MICROS_PER_CENT = 10_000


def micros_to_cents(micros: int) -> int:
    """Half up, to whole cents (never negative here: costs are not)."""
    return (micros + MICROS_PER_CENT // 2) // MICROS_PER_CENT


def month_start(value: date) -> date:
    return value.replace(day=1)


def month_bounds(period_start: date) -> tuple[datetime, datetime]:
    start = datetime.combine(period_start, time.min, tzinfo=UTC)
    nxt = date(period_start.year + period_start.month // 12, period_start.month % 12 + 1, 1)
    return start, datetime.combine(nxt, time.min, tzinfo=UTC)


def _check_period(period_start: date) -> None:
    if not 2000 <= period_start.year <= 9998:
        raise ValidationError({"period_start": "Choose a month between 2000 and 9998."})
    if period_start.day != 1:
        raise ValidationError({"period_start": "An invoice covers a month: use its first day."})


def _check_over(period_start: date) -> None:
    _check_period(period_start)
    _, end = month_bounds(period_start)
    if timezone.now() < end:
        raise ValidationError(
            {
                "period_start": f"{period_start:%Y-%m} is not over yet; it can be finalized "
                f"from {end:%Y-%m-%d} (UTC)."
            }
        )


def _lines_from_ledger(invoice: Invoice) -> list[InvoiceLine]:
    start, end = month_bounds(invoice.period_start)
    groups = ledger_sums(tenant_id=invoice.tenant_id, start=start, end=end, by=("model", "mode"))
    return [
        InvoiceLine(
            invoice=invoice,
            model=g["model"],
            mode=g["mode"],
            requests=g["n"],
            prompt_tokens=g["prompt"],
            completion_tokens=g["completion"],
            cached_tokens=g["cached"],
            cost_micros=g["cost"],
            amount_cents=micros_to_cents(g["cost"]),
            unpriced=g["unpriced"],
        )
        for g in groups
    ]


@transaction.atomic
def invoice_compute(*, tenant: Tenant, period_start: date) -> Invoice:
    """The month's invoice, its draft (re)computed from the ledger. A finalized, paid or
    void invoice is returned as it is: it never changes again."""
    _check_period(period_start)
    invoice, _ = Invoice.objects.select_for_update().get_or_create(
        tenant=tenant, period_start=period_start
    )
    if invoice.status != Invoice.Status.DRAFT:
        return invoice
    lines = _lines_from_ledger(invoice)
    invoice.lines.all().delete()
    InvoiceLine.objects.bulk_create(lines)
    invoice.total_cents = sum(line.amount_cents for line in lines)
    invoice.cost_micros = sum(line.cost_micros for line in lines)
    invoice.save(update_fields=["total_cents", "cost_micros"])
    return invoice


def invoice_finalize(*, tenant: Tenant, period_start: date, actor: User | None) -> Invoice:
    """Freeze the month's invoice and send it to Stripe. Idempotent: finalizing an invoice
    that is no longer a draft returns it unchanged (and sends nothing again)."""
    _check_period(period_start)
    _, end = month_bounds(period_start)
    if timezone.now() < end:
        raise ValidationError(
            {
                "period_start": f"{period_start:%Y-%m} is not over yet; it can be finalized from "
                f"{end:%Y-%m-%d} (UTC)."
            }
        )
    with transaction.atomic():
        invoice = invoice_compute(tenant=tenant, period_start=period_start)
        if invoice.status != Invoice.Status.DRAFT:
            return invoice
        invoice.status = Invoice.Status.FINALIZED
        invoice.finalized_at = timezone.now()
        invoice.save(update_fields=["status", "finalized_at"])
        audit_record(
            actor=actor,
            tenant=tenant,
            action="invoice.finalize",
            target=invoice,
            details={"period": f"{period_start:%Y-%m}", "total_cents": invoice.total_cents},
        )
        if invoice.total_cents > 0:
            invoice_id = invoice.pk
            transaction.on_commit(
                lambda: invoice_finalized.send(sender=Invoice, invoice_id=invoice_id)
            )
    return invoice


def invoices_finalize_month(*, period_start: date) -> int:
    """Finalize the month's invoice of every tenant that used the platform in it. One
    tenant's failure is logged and does not stop the others (a rerun picks it up)."""
    _check_over(period_start)
    from billing.spool import usage_spool_flush

    usage_spool_flush()  # records the gateways already spooled belong to the month
    start, end = month_bounds(period_start)
    tenant_ids = (
        UsageRecord.objects.filter(started_at__gte=start, started_at__lt=end)
        .values_list("tenant_id", flat=True)
        .distinct()
    )
    done = 0
    for tenant in Tenant.objects.filter(pk__in=tenant_ids).order_by("pk"):
        try:
            invoice_finalize(tenant=tenant, period_start=period_start, actor=None)
            done += 1
        except Exception:
            log.exception("could not finalize %s's invoice for %s", tenant.slug, period_start)
    return done


def invoice_void(*, invoice: Invoice, actor: User | None) -> Invoice:
    """Void a finalized invoice (not a paid one: refund it at Stripe instead)."""
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
        if invoice.status == Invoice.Status.VOID:
            return invoice
        if invoice.status == Invoice.Status.PAID:
            raise ValidationError({"status": "A paid invoice cannot be voided; refund it."})
        if invoice.status == Invoice.Status.DRAFT:
            raise ValidationError(
                {"status": "A draft is not an invoice yet: there is nothing to void."}
            )
        invoice.status = Invoice.Status.VOID
        invoice.voided_at = timezone.now()
        invoice.save(update_fields=["status", "voided_at"])
        audit_record(actor=actor, tenant=invoice.tenant, action="invoice.void", target=invoice)
        if invoice.stripe_invoice_id:
            invoice_id = invoice.pk
            transaction.on_commit(
                lambda: invoice_voided.send(sender=Invoice, invoice_id=invoice_id)
            )
    return invoice
