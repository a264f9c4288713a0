from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.commands import parse_positive_int, validation_message
from tenants.models import MAX_RATE
from tenants.priority import DEFAULT_CLASS, PRIORITY_CLASSES
from tenants.services import tenant_create


class Command(BaseCommand):
    help = "Create a tenant. Prints its slug."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug")
        parser.add_argument("--name", default="")
        parser.add_argument("--weight", help="Fair-share weight, 1-1000 (default 1).")
        parser.add_argument(
            "--priority-class",
            choices=PRIORITY_CLASSES,
            default=DEFAULT_CLASS,
            help="The highest class its requests run in (docs/priority.md).",
        )
        parser.add_argument("--rpm", help="Requests per minute (default unlimited).")
        parser.add_argument("--tpm", help="Tokens per minute (default unlimited).")
        parser.add_argument("--max-concurrency", help="Requests in flight at once.")

    def handle(self, *args: Any, **options: Any) -> None:
        weight = parse_positive_int(options["weight"], option="--weight", maximum=1000) or 1
        limits = {
            "rpm": parse_positive_int(options["rpm"], option="--rpm", maximum=MAX_RATE),
            "tpm": parse_positive_int(options["tpm"], option="--tpm", maximum=MAX_RATE),
            "max_concurrency": parse_positive_int(
                options["max_concurrency"], option="--max-concurrency", maximum=MAX_RATE
            ),
        }
        try:
            tenant = tenant_create(
                slug=options["slug"],
                name=options["name"],
                weight=weight,
                priority_class=options["priority_class"],
                limits=limits,
                actor=None,
            )
        except ValidationError as exc:
            raise CommandError(validation_message(exc)) from None
        self.stdout.write(tenant.slug)
