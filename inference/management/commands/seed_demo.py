"""Seed what ``make run`` needs: an admin, tenant ``demo`` with a key, the tiny model, pools
and a list price for it.

Safe to re-run: existing rows are kept, and the demo key is re-issued only when the one
saved in ``var/demo-api-key`` no longer works.
"""

import json
import os
import secrets
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from billing.models import Price
from billing.services import price_set
from controlplane.commands import validation_message
from fleet.models import Model, Pool
from inference.services import model_ensure, pool_configure, pool_ensure
from tenants.models import Membership, Role, Tenant, User
from tenants.selectors import api_key_authenticate
from tenants.services import api_key_create, membership_add, tenant_create


def _private_file(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(content + "\n")


class Command(BaseCommand):
    help = "Create the demo admin, tenant, API key, model and pools (idempotent)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--online-url", default="http://127.0.0.1:8101")
        parser.add_argument("--batch-url", default="http://127.0.0.1:8102")
        parser.add_argument(
            "--online-discovery",
            help="Instead of --online-url: http://SERVICE-NAME:PORT, every address of that "
            "DNS name is a replica (configure_pool --discovery).",
        )
        parser.add_argument("--batch-discovery", help="The same for the batch pool.")
        parser.add_argument(
            "--guard-url",
            default="",
            help="An engine serving the tiny guard classifier (tiny-guard), registered as "
            "model tiny-guard on pool guard for moderation policies to name (make run: "
            "http://127.0.0.1:8103).",
        )
        parser.add_argument(
            "--embed-url",
            default="",
            help="An engine serving the tiny model as an embedding model (tiny-embed), "
            "registered as model tiny-embed on pool embed for /v1/embeddings (make run: "
            "http://127.0.0.1:8104).",
        )
        parser.add_argument("--model-name", default="tiny-chat")
        parser.add_argument("--context-length", type=int, default=1024)

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        var: Path = settings.VAR_DIR
        password_file = var / "admin-password"
        admin = User.objects.filter(username="admin").first()
        if admin is None:
            password = os.environ.get("INFERPLANE_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
            admin = User.objects.create_superuser("admin", "admin@example.com", password)
            _private_file(password_file, password)

        tenant = Tenant.objects.filter(slug="demo").first()
        if tenant is None:
            tenant = tenant_create(slug="demo", name="Demo tenant", actor=None)
        if not Membership.objects.filter(tenant=tenant, user=admin).exists():
            membership_add(tenant=tenant, user=admin, role=Role.OWNER, actor=None, actor_role=None)

        key_file = var / "demo-api-key"
        saved = key_file.read_text().strip() if key_file.exists() else ""
        if not saved or api_key_authenticate(raw_key=saved) is None:
            issued = api_key_create(tenant=tenant, name="demo", created_by=admin)
            _private_file(key_file, issued.secret)

        name = options["model_name"]
        # The tiny model's config (MODEL_DIR, set by the Makefile): what LoRA uploads are
        # checked against.
        config_file = Path(os.environ.get("MODEL_DIR", "")) / "config.json"
        architecture = None
        if config_file.is_file():
            # Adapters name their base by its weights' path; ours is the model directory.
            architecture = {
                **json.loads(config_file.read_text()),
                "_name_or_path": config_file.parent.name,
            }
        try:
            model = model_ensure(
                name=name,
                served_name=name,
                context_length=options["context_length"],
                supports_lora=architecture is not None,
                architecture=architecture,
            )
        except ValidationError as exc:
            raise CommandError(f"--model-name {name!r}: {' '.join(exc.messages)}") from None
        for pool, kind in (("online", "dedicated"), ("batch", "spot")):
            discovery = options[f"{pool}_discovery"]
            new = not Pool.objects.filter(name=pool).exists()
            try:
                made = pool_ensure(
                    name=pool,
                    kind=kind,
                    model=model,
                    replica_urls=[] if discovery else [options[f"{pool}_url"]],
                    discovery=discovery or "static",
                )
            except ValidationError as exc:
                raise CommandError(f"pool {pool}: {validation_message(exc)}") from None
            if new and kind == "spot":
                # Twice the engine's 64 sequences: it always holds the next lines queued
                # (docs/batches.md). An operator's later setting is left alone.
                pool_configure(pool=made, max_inflight=128)
        if options["guard_url"]:
            # The tiny guard classifier (moderation's third backend), on a pool of its own.
            guard = model_ensure(
                name="tiny-guard",
                served_name="tiny-guard",
                context_length=options["context_length"],
                task=Model.Task.CLASSIFY,
            )
            try:
                pool_ensure(
                    name="guard", kind="dedicated", model=guard, replica_urls=[options["guard_url"]]
                )
            except ValidationError as exc:
                raise CommandError(f"pool guard: {validation_message(exc)}") from None
            if not Price.objects.filter(model=guard, tenant=None).exists():
                # The guard's work is the tenant's too: a demo price for its prompt tokens.
                price_set(
                    model=guard,
                    input_per_mtok=Decimal("0.02"),
                    output_per_mtok=Decimal(0),
                    actor=None,
                )
        if options["embed_url"]:
            self._embed_pool(options["embed_url"], options["context_length"])
        if not Price.objects.filter(model=model, tenant=None).exists():
            # A demo list price, so usage shows costs from the first request.
            price_set(
                model=model,
                input_per_mtok=Decimal("0.15"),
                cached_input_per_mtok=Decimal("0.075"),
                output_per_mtok=Decimal("0.60"),
                batch_discount_percent=Decimal(50),
                actor=None,
            )
        self.stdout.write(
            "Seeded admin, tenant demo, its API key, models, pools online, batch, guard and "
            "embed, their prices."
        )

    def _embed_pool(self, url: str, context_length: int) -> None:
        """The tiny model as an embedding model (``/v1/embeddings``), on a pool of its own."""
        embed = model_ensure(
            name="tiny-embed",
            served_name="tiny-embed",
            context_length=context_length,
            task=Model.Task.EMBED,
        )
        new = not Pool.objects.filter(name="embed").exists()
        try:
            made = pool_ensure(name="embed", kind="dedicated", model=embed, replica_urls=[url])
        except ValidationError as exc:
            raise CommandError(f"pool embed: {validation_message(exc)}") from None
        if new:
            # Embedding is prefill only: the engine takes a request's inputs together, up to
            # its 64 sequences (a request of more inputs than this is refused).
            pool_configure(pool=made, max_inflight=64)
        # Batch lines of /v1/embeddings run on a spot pool: here the same engine, lent a
        # quarter of its sequences (the two pools' admissions do not see each other).
        new = not Pool.objects.filter(name="embed-batch").exists()
        try:
            spot = pool_ensure(name="embed-batch", kind="spot", model=embed, replica_urls=[url])
        except ValidationError as exc:
            raise CommandError(f"pool embed-batch: {validation_message(exc)}") from None
        if new:
            pool_configure(pool=spot, max_inflight=16)
        if not Price.objects.filter(model=embed, tenant=None).exists():
            price_set(
                model=embed,
                input_per_mtok=Decimal("0.02"),
                output_per_mtok=Decimal(0),
                batch_discount_percent=Decimal(50),
                actor=None,
            )
