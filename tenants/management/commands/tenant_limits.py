from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.commands import parse_positive_int, validation_message
from tenants.models import MAX_BUDGET, MAX_RATE, Tenant
from tenants.selectors import tenant_get_by_slug
from tenants.services import tenant_limits_update

# option, field, largest value, what "none" means for it
OPTIONS = (
    ("--rpm", "rpm", MAX_RATE, "unlimited"),
    ("--tpm", "tpm", MAX_RATE, "unlimited"),
    ("--max-concurrency", "max_concurrency", MAX_RATE, "unlimited"),
    ("--storage-mb", "storage_mb", MAX_RATE, "the default"),
    ("--open-batches", "max_open_batches", MAX_RATE, "the default"),
    ("--batch-queue-tokens", "batch_queue_tokens", MAX_BUDGET, "the default"),
)


class Command(BaseCommand):
    help = (
        "Show a tenant's limits and quotas, or change the ones given ('none': unlimited for "
        "the rates, the platform's default for the quotas). Prints them as they apply."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug")
        for option, _, _, cleared in OPTIONS:
            parser.add_argument(option, help=f"A whole number, or 'none' ({cleared}).")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            tenant = tenant_get_by_slug(slug=options["slug"])
        except Tenant.DoesNotExist:
            raise CommandError(f"no tenant with slug {options['slug']!r}") from None
        changes: dict[str, int | None] = {}
        for option, field, maximum, _ in OPTIONS:
            value = options[option[2:].replace("-", "_")]
            if value is None:
                continue
            cleared = value.strip().lower() == "none"
            changes[field] = (
                None if cleared else parse_positive_int(value, option=option, maximum=maximum)
            )
        if changes:
            try:
                tenant = tenant_limits_update(tenant=tenant, actor=None, limits=changes)
            except ValidationError as exc:
                raise CommandError(validation_message(exc)) from None
        for _, field, _, _ in OPTIONS:
            own = getattr(tenant, field)
            if field in Tenant.QUOTA_NAMES:
                shown = f"{tenant.quota(field)}" + (" (default)" if own is None else "")
            else:
                shown = "unlimited" if own is None else str(own)
            self.stdout.write(f"{field}: {shown}")
