from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from redis.exceptions import RedisError

from controlplane.commands import parse_positive_int, validation_message
from inference.services import response_cache_purge
from tenants.models import Tenant
from tenants.selectors import tenant_get_by_slug
from tenants.services import tenant_cache_update


class Command(BaseCommand):
    help = (
        "Show a tenant's response cache (docs/cache.md), turn it on or off, set how long an "
        "answer is served, or purge every answer it holds."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug")
        parser.add_argument("--mode", choices=[value for value, _ in Tenant.Cache.choices])
        parser.add_argument("--ttl", help="Seconds an answer is served (60 to 2592000).")
        parser.add_argument("--threshold", type=float, help="Semantic: similarity (0.5 to 1).")
        parser.add_argument("--embedding-model", help="Semantic: the model that embeds.")
        parser.add_argument("--purge", action="store_true", help="Forget every answer held.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            tenant = tenant_get_by_slug(slug=options["slug"])
        except Tenant.DoesNotExist:
            raise CommandError(f"no tenant with slug {options['slug']!r}") from None
        ttl = options["ttl"]
        try:
            tenant = tenant_cache_update(
                tenant=tenant,
                actor=None,
                mode=options["mode"],
                threshold=options["threshold"],
                embedding_model=options["embedding_model"],
                ttl_seconds=None
                if ttl is None
                else parse_positive_int(ttl, option="--ttl", maximum=30 * 86400),
            )
        except ValidationError as exc:
            raise CommandError(validation_message(exc)) from None
        if options["purge"]:
            try:
                purged = response_cache_purge(tenant=tenant, actor=None)
            except RedisError as exc:
                raise CommandError(f"Redis is unavailable: {exc}") from None
            self.stdout.write(f"purged: {purged}")
        self.stdout.write(f"mode: {tenant.response_cache}")
        self.stdout.write(f"ttl_seconds: {tenant.response_cache_ttl_seconds}")
        if tenant.response_cache == Tenant.Cache.SEMANTIC:
            self.stdout.write(f"threshold: {tenant.response_cache_threshold}")
            self.stdout.write(f"embedding_model: {tenant.response_cache_embedding_model}")
