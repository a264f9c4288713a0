import logging
from datetime import timedelta
from typing import Any

from celery import shared_task
from django.dispatch import receiver
from django.utils import timezone

from billing.invoicing import invoices_finalize_month
from billing.reconcile import counter_snapshots_take
from billing.services import (
    daily_usage_refresh_recent,
    daily_usage_refresh_stale,
)
from billing.signals import invoice_finalized, invoice_voided
from billing.stripe_sync import StripeNotConfigured, invoice_stripe_push, invoice_stripe_void

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def daily_usage_refresh_task() -> int:
    return daily_usage_refresh_stale()


@shared_task(ignore_result=True)
def daily_usage_refresh_recent_task() -> int:
    return daily_usage_refresh_recent()


@shared_task(
    ignore_result=True,
    autoretry_for=(Exception,),
    retry_backoff=30,
    retry_backoff_max=3600,
    max_retries=12,
)
def invoice_stripe_push_task(invoice_id: int) -> None:
    try:
        invoice_stripe_push(invoice_id=invoice_id)
    except StripeNotConfigured:
        log.warning("invoice %s finalized; not sent: STRIPE_API_KEY is not set", invoice_id)


@shared_task(ignore_result=True, autoretry_for=(Exception,), retry_backoff=30, max_retries=12)
def invoice_stripe_void_task(invoice_id: int) -> None:
    try:
        invoice_stripe_void(invoice_id=invoice_id)
    except StripeNotConfigured:
        log.warning("invoice %s voided; not at Stripe: STRIPE_API_KEY is not set", invoice_id)


@shared_task(ignore_result=True)
def invoices_finalize_last_month_task() -> int:
    last_month = (timezone.now().date().replace(day=1) - timedelta(days=1)).replace(day=1)
    return invoices_finalize_month(period_start=last_month)


@shared_task(ignore_result=True)
def counter_snapshots_take_task() -> int:
    return counter_snapshots_take()


@receiver(invoice_finalized)
def _finalized(sender: Any, *, invoice_id: int, **_: Any) -> None:
    invoice_stripe_push_task.delay(invoice_id)


@receiver(invoice_voided)
def _voided(sender: Any, *, invoice_id: int, **_: Any) -> None:
    invoice_stripe_void_task.delay(invoice_id)
