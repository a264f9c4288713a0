from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.commands import parse_positive_int, validation_message
from fleet.models import Pool
from inference.selectors import pool_get
from inference.services import pool_configure


class Command(BaseCommand):
    help = "Change a pool's admission settings. Takes effect on every web process within a second."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument(
            "--max-inflight",
            help="Sequences admitted at once per ready replica (a request of n=4 is four).",
        )
        parser.add_argument("--policy", help="vtc (token-fair between tenants) or fcfs.")
        parser.add_argument("--max-queue-wait", help="Seconds a request may wait for admission.")
        parser.add_argument(
            "--max-loras", help="The engines' --max-loras: adapters one replica holds at once."
        )
        parser.add_argument(
            "--max-lora-rank", help="The engines' --max-lora-rank: the highest adapter rank."
        )
        parser.add_argument(
            "--discovery",
            help="Where the replicas come from: 'static' (registered by hand) or "
            "http(s)://SERVICE-NAME:PORT (every address of that DNS name is a replica, "
            "re-resolved at every probe round).",
        )
        parser.add_argument(
            "--lend-percent",
            help="Online pools: the percent of the pool's capacity that batch lines may borrow "
            "while no online request waits (0 lends none); its engines must run with "
            "--scheduling-policy priority.",
        )
        parser.add_argument(
            "--drain-grace",
            help="Seconds a replica whose address left DNS may keep running requests before "
            "it is removed regardless.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            pool = pool_get(name=options["name"])
        except Pool.DoesNotExist:
            raise CommandError(f"no pool named {options['name']!r}") from None
        policy = options["policy"]
        if policy is not None and policy not in Pool.Policy.values:
            raise CommandError(f"--policy must be one of {', '.join(Pool.Policy.values)}")
        try:
            pool = pool_configure(
                pool=pool,
                max_inflight=parse_positive_int(
                    options["max_inflight"], option="--max-inflight", maximum=4096
                ),
                policy=policy,
                max_queue_wait_seconds=parse_positive_int(
                    options["max_queue_wait"], option="--max-queue-wait", maximum=3600
                ),
                max_loras=parse_positive_int(
                    options["max_loras"], option="--max-loras", maximum=256
                ),
                max_lora_rank=parse_positive_int(
                    options["max_lora_rank"], option="--max-lora-rank", maximum=512
                ),
                discovery=options["discovery"],
                lend_percent=parse_positive_int(
                    options["lend_percent"], option="--lend-percent", maximum=100, minimum=0
                ),
                drain_grace_seconds=parse_positive_int(
                    options["drain_grace"], option="--drain-grace", maximum=86400
                ),
            )
        except ValidationError as exc:
            raise CommandError(validation_message(exc)) from None
        self.stdout.write(
            f"{pool.name}: max_inflight={pool.max_inflight} policy={pool.policy} "
            f"max_queue_wait={pool.max_queue_wait_seconds}s max_loras={pool.max_loras} "
            f"max_lora_rank={pool.max_lora_rank} lend_percent={pool.lend_percent} "
            f"discovery={pool.discovery_url}"
        )
