from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from billing.services import price_set
from controlplane.commands import validation_message
from fleet.models import Model
from tenants.models import Tenant
from tenants.selectors import tenant_get_by_slug


def _usd(value: str | None, option: str) -> Decimal | None:
    if value is None:
        return None
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise CommandError(f"{option} must be a dollar amount like 0.15, not {value!r}") from None
    exponent = amount.as_tuple().exponent
    if not amount.is_finite() or amount < 0 or (isinstance(exponent, int) and exponent < -6):
        raise CommandError(f"{option} must be a non-negative amount with at most 6 decimals")
    return amount


def _percent(value: str | None, option: str) -> Decimal:
    if value is None:
        return Decimal(0)
    try:
        percent = Decimal(value)
    except InvalidOperation:
        raise CommandError(f"{option} must be a percentage like 50, not {value!r}") from None
    exponent = percent.as_tuple().exponent
    if not percent.is_finite() or percent < 0 or (isinstance(exponent, int) and exponent < -2):
        raise CommandError(f"{option} must be a non-negative percentage with at most 2 decimals")
    return percent


class Command(BaseCommand):
    help = (
        "Add a price for a model (dollars per 1M tokens), in force from now or a later moment; "
        "with --tenant, that tenant's contract price."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", help="The model's public name, e.g. tiny-chat.")
        parser.add_argument("--input", required=True, help="Per 1M prompt tokens, e.g. 0.15")
        parser.add_argument("--output", required=True, help="Per 1M completion tokens.")
        parser.add_argument("--cached", help="Per 1M cached prompt tokens (default: --input).")
        parser.add_argument("--batch-discount", help="Percent off batch-mode usage, 0-100.")
        parser.add_argument(
            "--interactive-surcharge",
            help="Percent on online usage of the interactive priority class (docs/priority.md).",
        )
        parser.add_argument(
            "--background-discount",
            help="Percent off online usage of the background priority class, 0-100.",
        )
        parser.add_argument("--from", dest="start", help="ISO date-time (UTC); default: now.")
        parser.add_argument("--tenant", help="A tenant's slug: its contract price.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            model = Model.objects.get(name=options["model"])
        except Model.DoesNotExist:
            raise CommandError(f"no model named {options['model']!r}") from None
        tenant = None
        if options["tenant"]:
            try:
                tenant = tenant_get_by_slug(slug=options["tenant"])
            except Tenant.DoesNotExist:
                raise CommandError(f"no tenant with slug {options['tenant']!r}") from None
        start = None
        if options["start"]:
            try:
                start = datetime.fromisoformat(options["start"])
            except ValueError:
                raise CommandError(
                    f"--from must be a date-time like 2026-12-01T00:00, not {options['start']!r}"
                ) from None
            if timezone.is_naive(start):
                start = start.replace(tzinfo=UTC)
        percents = {
            name: _percent(options[name], "--" + name.replace("_", "-"))
            for name in ("batch_discount", "interactive_surcharge", "background_discount")
        }
        try:
            price = price_set(
                model=model,
                tenant=tenant,
                input_per_mtok=_usd(options["input"], "--input") or Decimal(0),
                cached_input_per_mtok=_usd(options["cached"], "--cached"),
                output_per_mtok=_usd(options["output"], "--output") or Decimal(0),
                batch_discount_percent=percents["batch_discount"],
                interactive_surcharge_percent=percents["interactive_surcharge"],
                background_discount_percent=percents["background_discount"],
                effective_from=start,
                actor=None,
            )
        except ValidationError as exc:
            raise CommandError(validation_message(exc)) from None
        who = f" for {tenant.slug}" if tenant else ""
        self.stdout.write(
            f"{model.name}{who}: input ${price.input_per_mtok} cached "
            f"${price.cached_input_per_mtok} output ${price.output_per_mtok} per 1M tokens, "
            f"batch -{price.batch_discount_percent}%, interactive "
            f"+{price.interactive_surcharge_percent}%, background "
            f"-{price.background_discount_percent}% from {price.effective_from.isoformat()}"
        )
