"""Ready adapters as the serving catalog lists them (``inference.catalog`` publishes it)."""

from __future__ import annotations

import logging

from adapters.models import Adapter
from adapters.services import adapter_local_dir
from contract import AdapterVersion, CatalogAdapter

log = logging.getLogger(__name__)


def adapters_for_catalog(models: set[str]) -> dict[str, CatalogAdapter]:
    """Ready adapters by ``<tenant-slug>/<name>``: whose they are, their base model, and per
    version the engine-side name and the directory an engine loads them from."""
    versions: dict[str, dict[str, AdapterVersion]] = {}
    first: dict[str, Adapter] = {}
    latest: dict[str, int] = {}
    ready = (
        Adapter.objects.filter(status=Adapter.Status.READY, deleted_at__isnull=True)
        .select_related("tenant", "base_model")
        .order_by("tenant__slug", "name", "version")
    )
    for adapter in ready:
        if adapter.base_model is None or adapter.base_model.name not in models:
            continue
        address = f"{adapter.tenant.slug}/{adapter.name}"
        first.setdefault(address, adapter)
        try:
            path = adapter_local_dir(adapter=adapter)
        except OSError:  # storage unreachable: not servable until the next publish
            log.warning("adapter %s has no local copy for the engines", adapter, exc_info=True)
            path = ""
        versions.setdefault(address, {})[str(adapter.version)] = AdapterVersion(
            engine_name=f"{address}:{adapter.version}", path=path, model=adapter.base_model.name
        )
        latest[address] = adapter.version  # ordered by version: the newest wins
    return {
        address: CatalogAdapter(
            tenant=first[address].tenant_id,
            created=int(first[address].created_at.timestamp()),
            latest=latest[address],
            versions=found,
        )
        for address, found in versions.items()
    }
