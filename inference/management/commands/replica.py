"""Register, drain, bring back and remove engine replicas by hand.

Pools with DNS discovery register their replicas themselves (``configure_pool NAME
--discovery http://SERVICE:PORT``); this is for static pools and for the exceptions.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.commands import validation_message
from fleet.models import Pool, Replica
from inference.selectors import pool_get, pool_list, replica_find, replicas_in_flight
from inference.services import replica_add, replica_drain, replica_remove, replica_undrain


class Command(BaseCommand):
    help = (
        "Manage engine replicas: add POOL URL, drain REPLICA, ready REPLICA, remove REPLICA "
        "[--force], list [POOL]. REPLICA is its URL or its name (add --pool when several "
        "pools have it). Changes reach every web process within a second."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", metavar="add|drain|ready|remove|list")
        sub.required = True
        add = sub.add_parser("add", help="Register an engine's base URL as a replica of POOL.")
        add.add_argument("pool")
        add.add_argument("url")
        add.add_argument("--name", default="", help="Its short name (default: <pool>-<n>).")
        for action, text in (
            ("drain", "Send it no new requests; the running ones finish."),
            ("ready", "Bring a drained replica back (probed now: ready if it answers)."),
            ("remove", "Remove it; refused while requests run on it, unless --force."),
        ):
            one = sub.add_parser(action, help=text)
            one.add_argument("replica", help="Its URL (http://...) or its name.")
            one.add_argument("--pool", help="The pool, when several have that URL.")
            if action == "remove":
                one.add_argument(
                    "--force",
                    action="store_true",
                    help="Remove it even with requests in flight (they finish on the engine "
                    "if it stays up, otherwise fail).",
                )
        listing = sub.add_parser("list", help="Every replica (of POOL) with state and load.")
        listing.add_argument("pool", nargs="?")

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        try:
            if action == "add":
                self._add(options)
            elif action == "list":
                self._list(options.get("pool"))
            else:
                self._one(action, options)
        except ValidationError as exc:
            raise CommandError(validation_message(exc)) from None

    def _pool(self, name: str) -> Pool:
        try:
            return pool_get(name=name)
        except Pool.DoesNotExist:
            raise CommandError(f"no pool named {name!r}") from None

    def _add(self, options: dict[str, Any]) -> None:
        pool = self._pool(options["pool"])
        replica = replica_add(pool=pool, url=options["url"], name=options["name"])
        self.stdout.write(
            f"{replica.name} {replica.url}: added to pool {pool.name} "
            "(down until its first probe says it is ready)"
        )

    def _one(self, action: str, options: dict[str, Any]) -> None:
        ref, pool = options["replica"], options.get("pool")
        if pool is not None:
            self._pool(pool)
        try:
            replica = replica_find(ref=ref, pool=pool)
        except Replica.DoesNotExist:
            where = f" in pool {pool!r}" if pool else ""
            raise CommandError(f"no replica {ref!r}{where}") from None
        except Replica.MultipleObjectsReturned:
            raise CommandError(f"several pools have a replica {ref!r}: add --pool") from None
        if action == "drain":
            replica = replica_drain(replica=replica)
            self.stdout.write(f"{replica.name} {replica.url}: draining (no new requests)")
        elif action == "ready":
            replica = replica_undrain(replica=replica)
            detail = f" ({replica.last_error})" if replica.last_error else ""
            self.stdout.write(f"{replica.name} {replica.url}: {replica.state}{detail}")
        else:
            name, url = replica.name, replica.url
            in_flight = replica_remove(replica=replica, force=options["force"])
            extra = f" with {in_flight} request(s) in flight" if in_flight else ""
            self.stdout.write(f"{name} {url}: removed{extra}")

    def _list(self, pool_name: str | None) -> None:
        pools = [self._pool(pool_name)] if pool_name else list(pool_list())
        for pool in pools:
            load = replicas_in_flight(pool=pool)
            self.stdout.write(f"{pool.name} ({pool.discovery_url}):")
            for r in pool.replicas.all():
                self.stdout.write(
                    f"  {r.name}\t{r.url}\t{r.state}\t{load.get(r.pk, '?')} in flight"
                )
