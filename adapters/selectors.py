"""Reads: a tenant's adapters, only through the tenant."""

from __future__ import annotations

from django.db.models import QuerySet

from adapters.models import Adapter
from tenants.models import Tenant


def adapter_list(*, tenant: Tenant) -> QuerySet[Adapter]:
    return Adapter.objects.filter(tenant=tenant, deleted_at__isnull=True).order_by(
        "name", "-version"
    )


def adapter_get(*, tenant: Tenant, name: str, version: int) -> Adapter:
    """Raises ``Adapter.DoesNotExist`` for another tenant's adapter, as for a missing one."""
    return Adapter.objects.get(tenant=tenant, name=name, version=version, deleted_at__isnull=True)
