import contextlib
import csv
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from billing.exports import USAGE_HEADER, usage_row
from billing.selectors import usage_records_for_export
from tenants.models import Tenant
from tenants.selectors import tenant_get_by_slug


def _day(value: str, option: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise CommandError(f"{option} must be a date like 2026-11-30, not {value!r}") from None


class Command(BaseCommand):
    help = "Write a tenant's usage records as CSV on stdout (UTC days, both ends included)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenant", required=True)
        parser.add_argument("--start", required=True, help="First day, YYYY-MM-DD (UTC).")
        parser.add_argument("--end", required=True, help="Last day, YYYY-MM-DD (UTC).")

    def handle(self, *args: Any, **options: Any) -> None:
        start, end = _day(options["start"], "--start"), _day(options["end"], "--end")
        if end < start:
            raise CommandError("--end is before --start")
        try:
            tenant = tenant_get_by_slug(slug=options["tenant"])
        except Tenant.DoesNotExist:
            raise CommandError(f"no tenant with slug {options['tenant']!r}") from None
        with contextlib.suppress(BrokenPipeError):  # `| head` closed the pipe: not an error
            self.write_csv(tenant, start, end)

    def write_csv(self, tenant: Tenant, start: date, end: date) -> None:
        writer = csv.writer(self.stdout, lineterminator="\n")
        writer.writerow(USAGE_HEADER)
        records = usage_records_for_export(
            tenant=tenant,
            start=datetime.combine(start, time.min, tzinfo=UTC),
            end=datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC),
        )
        for r in records:
            writer.writerow(usage_row(r, tenant.slug))
