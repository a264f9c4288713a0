from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from billing.reconcile import usage_reconcile
from billing.spool import usage_spool_flush
from fleet.models import Pool


class Command(BaseCommand):
    help = (
        "Compare the ledger with the engines' own token counters, per replica of a pool, "
        "over a window ending now. Exits 1 when they differ."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--pool", required=True)
        parser.add_argument(
            "--since", help="Window start, ISO date-time (UTC); default: 24 hours ago."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            pool = Pool.objects.get(name=options["pool"])
        except Pool.DoesNotExist:
            raise CommandError(f"no pool named {options['pool']!r}") from None
        since = timezone.now() - timedelta(hours=24)
        if options["since"]:
            try:
                since = datetime.fromisoformat(options["since"])
            except ValueError:
                raise CommandError(
                    f"--since must be a date-time like 2026-11-29T10:00, not {options['since']!r}"
                ) from None
            if timezone.is_naive(since):
                since = since.replace(tzinfo=UTC)
        usage_spool_flush()  # what the gateways already spooled belongs in the ledger
        results = usage_reconcile(pool=pool, since=since)
        differ = False
        self.stdout.write(
            "replica,window_start,window_end,records,engine_prompt,ledger_prompt,prompt_diff,"
            "engine_generation,ledger_completion,generation_diff,exact,note"
        )
        for r in results:
            differ |= bool(r.prompt_diff or r.generation_diff or r.window_start is None)
            self.stdout.write(
                ",".join(
                    str(v)
                    for v in (
                        r.replica,
                        r.window_start.isoformat() if r.window_start else "",
                        r.window_end.isoformat() if r.window_end else "",
                        r.records,
                        r.engine_prompt,
                        r.ledger_prompt,
                        r.prompt_diff,
                        r.engine_generation,
                        r.ledger_completion,
                        r.generation_diff,
                        "yes" if r.exact else "no (requests in flight at an edge)",
                        r.note,
                    )
                )
            )
        if differ:
            raise SystemExit(1)
