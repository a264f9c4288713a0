"""Wait until the web server and every replica answer, then print how to get in.

``make run`` starts this beside the other processes; it is the line the newcomer waits for.
"""

import time
from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from fleet.models import Replica
from inference.selectors import replica_list
from inference.services import replica_probe


class Command(BaseCommand):
    help = "Wait for the web server and all replicas, then print the URL, login and demo key."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--web", default="http://127.0.0.1:8000")
        parser.add_argument("--timeout", type=float, default=600)

    def handle(self, *args: Any, **options: Any) -> None:
        deadline = time.monotonic() + options["timeout"]
        web = options["web"]
        pending: list[str] = []
        next_report = time.monotonic() + 15
        while time.monotonic() < deadline:
            pending = []
            try:
                httpx.get(f"{web}/healthz", timeout=2).raise_for_status()
            except httpx.HTTPError:
                pending.append(f"web {web}")
            for replica in replica_list():
                if replica_probe(replica=replica).state != Replica.State.READY:
                    pending.append(f"replica {replica}")
            if not pending:
                break
            if time.monotonic() >= next_report:  # engines take a minute or two on CPUs
                self.stdout.write(f"still starting: {', '.join(pending)}")
                self.stdout.flush()
                next_report += 15
            time.sleep(2)
        else:
            raise CommandError(f"not ready after {options['timeout']:.0f}s: {', '.join(pending)}")

        var = settings.VAR_DIR
        password = (
            (var / "admin-password").read_text().strip()
            if (var / "admin-password").exists()
            else "(set by you)"
        )
        key = (var / "demo-api-key").read_text().strip()
        banner = [
            "",
            "=" * 72,
            "Inferplane is running.",
            f"  Dashboard         : {web}/app/   (login: admin / {password})",
            f"  Django admin      : {web}/admin/",
            f"  Control API       : {web}/api/   (schema: {web}/api/schema/)",
            f"  OpenAI API        : {web}/v1",
            f"  Demo API key      : {key}",
            "  Ctrl-C stops everything.",
            "=" * 72,
            "",
        ]
        self.stdout.write("\n".join(banner))
        self.stdout.flush()
