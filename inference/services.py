"""Writes for models, pools and replicas."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inference.catalog import catalog_publish
from inference.models import Model, Pool, Replica

log = logging.getLogger(__name__)


@transaction.atomic
def model_ensure(
    *,
    name: str,
    served_name: str,
    context_length: int,
    supports_lora: bool = False,
    architecture: dict[str, Any] | None = None,
) -> Model:
    defaults: dict[str, Any] = {
        "served_name": served_name,
        "context_length": context_length,
        "supports_lora": supports_lora,
    }
    if architecture is not None:
        defaults["architecture"] = architecture
    model, _ = Model.objects.update_or_create(name=name, defaults=defaults)
    transaction.on_commit(catalog_publish)
    return model


@transaction.atomic
def pool_ensure(*, name: str, kind: str, model: Model, replica_urls: list[str]) -> Pool:
    """Create or update a pool and make its replica set exactly ``replica_urls``."""
    urls = [url.rstrip("/") for url in replica_urls]
    pool, _ = Pool.objects.update_or_create(name=name, defaults={"kind": kind, "model": model})
    pool.replicas.exclude(url__in=urls).delete()
    for url in urls:
        Replica.objects.get_or_create(pool=pool, url=url)
    transaction.on_commit(catalog_publish)
    return pool


@transaction.atomic
def pool_configure(
    *,
    pool: Pool,
    max_inflight: int | None = None,
    policy: str | None = None,
    max_queue_wait_seconds: int | None = None,
) -> Pool:
    for field, value in (
        ("max_inflight", max_inflight),
        ("policy", policy),
        ("max_queue_wait_seconds", max_queue_wait_seconds),
    ):
        if value is not None:
            setattr(pool, field, value)
    pool.full_clean()
    pool.save()
    transaction.on_commit(catalog_publish)
    return pool


@transaction.atomic
def replica_set_state(*, replica: Replica, state: str) -> Replica:
    """An operator's decision (drain for an upgrade, bring back): probes keep draining as is."""
    replica.state = state
    replica.full_clean()
    replica.save(update_fields=["state"])
    transaction.on_commit(catalog_publish)
    return replica


def replica_probe(*, replica: Replica, timeout: float | None = None) -> Replica:
    """Ask the engine whether it is healthy and serves the pool's model; record the answer.

    A draining replica stays draining (an operator put it there); others become ready or down.
    """
    timeout = timeout or settings.INFERPLANE_PROBE_TIMEOUT_SECONDS
    served = replica.pool.model.served_name
    error = ""
    try:
        with httpx.Client(base_url=replica.url, timeout=timeout) as client:
            client.get("/health").raise_for_status()
            models = client.get("/v1/models").raise_for_status().json()
        names = {m.get("id") for m in models.get("data", [])}
        if served not in names:
            error = f"engine does not serve {served!r} (it serves {sorted(names)})"
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    previous = replica.state
    if replica.state != Replica.State.DRAINING:
        replica.state = Replica.State.DOWN if error else Replica.State.READY
    replica.last_error = error
    replica.last_probe_at = timezone.now()
    replica.save(update_fields=["state", "last_error", "last_probe_at"])
    if replica.state != previous:
        log.info("replica %s: %s -> %s %s", replica, previous, replica.state, error)
    return replica
