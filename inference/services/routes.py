"""A model name's route (canaries): weighted targets, each a model or a LoRA adapter."""

from __future__ import annotations

import logging
import re

from django.core.exceptions import ValidationError
from django.db import transaction

from adapters.models import Adapter
from fleet.models import (
    Model,
    ModelRoute,
    name_validator,
)
from inference.catalog import catalog_publish
from inference.services.fleet import platform_audit
from tenants.models import User

log = logging.getLogger(__name__)


# --- routes (canaries) ---------------------------------------------------------------------

MAX_ROUTE_TARGETS = 8
MAX_ROUTE_WEIGHT = 10_000
_ADAPTER_ADDRESS = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}/[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def model_route_set(
    *, name: str, targets: list[tuple[str, int]], actor: User | None = None
) -> ModelRoute:
    """Point ``name`` at weighted targets (a canary; weights are integers, 0 sends none).
    Every web process follows within a second (the catalog); requests already running keep
    their target. ``name`` is a model's public name (then each target is a model that
    generates text) or a tenant's adapter address ``<slug>/<name>`` (then each target is a
    version of it, ``<slug>/<name>:<version>``). ValidationError, with what is wrong, else."""
    errors = _route_errors(name, targets)
    if errors:
        raise ValidationError(errors)
    before = ModelRoute.objects.filter(name=name).values_list("targets", flat=True).first()
    route, _ = ModelRoute.objects.update_or_create(
        name=name, defaults={"targets": [[target, weight] for target, weight in targets]}
    )
    platform_audit(actor, "route.set", route, {"before": before, "after": route.targets})
    transaction.on_commit(catalog_publish)
    log.info("route %s -> %s", name, ", ".join(f"{t}={w}" for t, w in targets))
    return route


def model_route_clear(*, name: str, actor: User | None = None) -> bool:
    """Stop routing ``name`` (it is a plain model name again, or unknown). Whether it was."""
    route = ModelRoute.objects.filter(name=name).first()
    if route is None:
        return False
    platform_audit(actor, "route.clear", route, {"before": route.targets})
    deleted, _ = ModelRoute.objects.filter(name=name).delete()
    if deleted:
        transaction.on_commit(catalog_publish)
    return bool(deleted)


def _route_errors(name: str, targets: list[tuple[str, int]]) -> list[str]:
    errors = []
    adapter_route = "/" in name
    if adapter_route:
        if not _ADAPTER_ADDRESS.match(name):
            errors.append(f"{name!r} is not an adapter address like acme/support-bot.")
    else:
        try:
            name_validator(name)
        except ValidationError:
            errors.append(f"{name!r} is not a model name (letters, digits, '.', '_', ':', '-').")
    if not 1 <= len(targets) <= MAX_ROUTE_TARGETS:
        errors.append(f"Give between 1 and {MAX_ROUTE_TARGETS} targets.")
    names = [target for target, _ in targets]
    if len(set(names)) != len(names):
        errors.append("Name each target once.")
    for target, weight in targets:
        if not (isinstance(weight, int) and 0 <= weight <= MAX_ROUTE_WEIGHT):
            errors.append(f"{target}: the weight must be a whole number from 0 to 10000.")
    if targets and sum(weight for _, weight in targets) <= 0:
        errors.append("At least one target needs a weight above 0.")
    if errors:
        return errors
    if adapter_route:
        slug, _, adapter = name.partition("/")
        versions = set(
            Adapter.objects.filter(
                tenant__slug=slug,
                name=adapter,
                status=Adapter.Status.READY,
                deleted_at__isnull=True,
            ).values_list("version", flat=True)
        )
        for target in names:
            address, _, version = target.partition(":")
            if address != name or not version.isdigit() or int(version) not in versions:
                errors.append(f"{target}: not a ready version of {name} ({name}:<version>).")
        return errors
    models = dict(Model.objects.filter(name__in=names).values_list("name", "task"))
    for target in names:
        if target not in models:
            errors.append(f"{target}: no such model.")
        elif models[target] != Model.Task.GENERATE:
            errors.append(f"{target}: a classification model cannot answer completions.")
    return errors
