from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.commands import validation_message
from tenants.models import Tenant
from tenants.selectors import tenant_get_by_slug
from tenants.services import api_key_create


class Command(BaseCommand):
    help = "Issue an API key for a tenant. The key is the last line printed; it is not stored."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug")
        parser.add_argument("--name", default="cli")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            tenant = tenant_get_by_slug(slug=options["slug"])
        except Tenant.DoesNotExist:
            raise CommandError(f"no tenant with slug {options['slug']!r}") from None
        try:
            issued = api_key_create(tenant=tenant, name=options["name"], created_by=None)
        except ValidationError as exc:
            raise CommandError(validation_message(exc)) from None
        key = issued.api_key
        self.stderr.write(
            f"Created key {key.display_prefix} ({key.name}) for {tenant.slug}."
            " Store it now: it cannot be shown again."
        )
        self.stdout.write(issued.secret)
