from datetime import date
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from billing.invoicing import invoice_finalize, invoices_finalize_month
from controlplane.commands import validation_message
from tenants.models import Tenant
from tenants.selectors import tenant_get_by_slug


class Command(BaseCommand):
    help = (
        "Finalize a month's invoices (every tenant with usage, or one) and queue them for "
        "Stripe. Idempotent: already finalized invoices are left as they are."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--month", required=True, help="YYYY-MM (UTC), a month that is over.")
        parser.add_argument("--tenant", help="Only this tenant's invoice.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            year, month = (int(x) for x in options["month"].split("-"))
            period = date(year, month, 1)
            if not 2000 <= year <= 9998:
                raise ValueError
        except ValueError:
            raise CommandError(
                f"--month must look like 2026-11, not {options['month']!r}"
            ) from None
        try:
            if options["tenant"]:
                try:
                    tenant = tenant_get_by_slug(slug=options["tenant"])
                except Tenant.DoesNotExist:
                    raise CommandError(f"no tenant with slug {options['tenant']!r}") from None
                invoice = invoice_finalize(tenant=tenant, period_start=period, actor=None)
                self.stdout.write(
                    f"{tenant.slug} {period:%Y-%m}: {invoice.status}, "
                    f"{invoice.total_cents / 100:.2f} {invoice.currency.upper()}"
                )
            else:
                count = invoices_finalize_month(period_start=period)
                self.stdout.write(f"{period:%Y-%m}: {count} invoice(s) finalized or already final")
        except ValidationError as exc:
            raise CommandError(validation_message(exc)) from None
