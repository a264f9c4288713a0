"""What adapters do when a lower app announces something (connected by ``AdaptersConfig``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Q
from django.dispatch import receiver

from adapters.models import Adapter
from billing.signals import adapters_used


@receiver(adapters_used)
def _used(sender: Any, *, latest: dict[tuple[int, str, int], datetime], **_: Any) -> None:
    """Each adapter's ``last_used_at`` moves to its latest use in the ledger (never back)."""
    for (tenant_id, name, version), when in latest.items():
        Adapter.objects.filter(tenant_id=tenant_id, name=name, version=version).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=when)
        ).update(last_used_at=when)
