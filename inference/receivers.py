"""What the fleet and the gateway do when the apps below them announce a change (their
``signals`` modules). Those apps never import ``inference``: the layers contract in
pyproject.toml holds them to it; this module is how their changes still reach the engines.
Connected once, in ``InferenceConfig.ready``; every receiver defers to the commit.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.dispatch import receiver

from adapters.models import Adapter
from adapters.signals import adapter_deleted, adapter_ready
from billing.signals import prices_changed
from inference.catalog import catalog_publish
from inference.keycache import keycache_invalidate
from inference.services import response_cache_forget
from inference.tasks import adapter_retire_task
from tenants.signals import keys_changed, response_cache_reset

# After the gateways' next catalog refresh (1 s): no new request can pick a deleted adapter.
RETIRE_AFTER_SECONDS = 3


@receiver(keys_changed, dispatch_uid="inference.keycache")
def _keys_changed(*, prefix: str = "", tenant_id: int | None = None, **_: Any) -> None:
    keycache_invalidate(prefix=prefix, tenant_id=tenant_id)


@receiver(prices_changed, dispatch_uid="inference.catalog.prices")
def _prices_changed(**_: Any) -> None:
    transaction.on_commit(catalog_publish)  # the gateway counts spend with them


@receiver(adapter_ready, dispatch_uid="inference.catalog.adapter_ready")
def _adapter_ready(**_: Any) -> None:
    transaction.on_commit(catalog_publish)


@receiver(adapter_deleted, dispatch_uid="inference.adapter_deleted")
def _adapter_deleted(*, adapter: Adapter, **_: Any) -> None:
    """Gateways stop routing to it within a second; the task then unloads it from the
    engines and removes its files once no running request uses it."""

    pk = adapter.pk
    transaction.on_commit(catalog_publish)
    transaction.on_commit(
        lambda: adapter_retire_task.apply_async((pk,), countdown=RETIRE_AFTER_SECONDS)
    )


@receiver(response_cache_reset, dispatch_uid="inference.response_cache_reset")
def _response_cache_reset(*, tenant_id: int, **_: Any) -> None:
    transaction.on_commit(lambda: response_cache_forget(tenant_id=tenant_id))
