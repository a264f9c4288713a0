"""Split a model name's requests between targets by weight: a canary, and its rollback.

manage.py model_route chat llama-3-8b=90 llama-3-8b-v2=10   # 10% to the new model
manage.py model_route chat llama-3-8b=100 llama-3-8b-v2=0   # roll back: all to stable
manage.py model_route chat                                  # show the route
manage.py model_route chat --clear                          # no route any more
manage.py model_route --list
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from controlplane.commands import validation_message
from fleet.models import ModelRoute
from inference.selectors import model_route_list
from inference.services import model_route_clear, model_route_set


def _parse(pair: str) -> tuple[str, int]:
    target, sep, weight = pair.rpartition("=")
    if not sep or not target or not weight.isdigit():
        raise CommandError(f"{pair!r}: give each target as TARGET=WEIGHT (a whole number)")
    return target, int(weight)


def _show(route: ModelRoute) -> str:
    total = sum(weight for _, weight in route.targets) or 1
    shares = "  ".join(
        f"{target}={weight} ({100 * weight / total:.0f}%)" for target, weight in route.targets
    )
    return f"{route.name}: {shares}"


class Command(BaseCommand):
    help = (
        "Route a model name to weighted targets (models, or versions of an adapter): "
        "model_route NAME TARGET=WEIGHT ... Every web process follows within a second; "
        "running requests keep their target. Without targets, show the route."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", nargs="?")
        parser.add_argument("targets", nargs="*", metavar="TARGET=WEIGHT")
        parser.add_argument("--clear", action="store_true", help="Remove the route.")
        parser.add_argument("--list", action="store_true", help="Show every route.")

    def handle(self, *args: Any, **options: Any) -> None:
        name, pairs = options["name"], options["targets"]
        if options["list"] or name is None:
            for route in model_route_list():
                self.stdout.write(_show(route))
            return
        if options["clear"]:
            if pairs:
                raise CommandError("--clear takes no targets")
            with transaction.atomic():
                cleared = model_route_clear(name=name)
            self.stdout.write(f"{name}: route removed" if cleared else f"{name}: no route")
            return
        if not pairs:
            found = model_route_list().filter(name=name).first()
            if found is None:
                raise CommandError(f"{name}: no route (give TARGET=WEIGHT ... to make one)")
            self.stdout.write(_show(found))
            return
        targets = [_parse(pair) for pair in pairs]
        try:
            with transaction.atomic():
                route = model_route_set(name=name, targets=targets)
        except ValidationError as exc:
            raise CommandError(validation_message(exc)) from None
        self.stdout.write(_show(route))
