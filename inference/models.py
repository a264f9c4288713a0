from __future__ import annotations

from django.db import models
from django.utils import timezone


class KeyCacheInvalidation(models.Model):
    """A change to a key or a tenant that the gateways' caches must see (the transactional
    outbox of ``inference.keycache``): written in the same transaction as the change, deleted
    once Redis holds the invalidation. A Redis hiccup at that moment only delays it."""

    prefix = models.CharField(max_length=32, blank=True)
    tenant_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.prefix or f"tenant {self.tenant_id}"
