"""Reads, always through the tenant."""

from __future__ import annotations

from django.db.models import QuerySet

from moderation.models import ModerationEvent, ModerationPolicy
from tenants.models import Tenant


def moderation_policy_get(*, tenant: Tenant) -> ModerationPolicy | None:
    return ModerationPolicy.objects.filter(tenant=tenant).first()


def moderation_events_list(
    *, tenant: Tenant, where: str | None = None, action: str | None = None
) -> QuerySet[ModerationEvent]:
    events = ModerationEvent.objects.filter(tenant=tenant)
    if where:
        events = events.filter(where=where)
    if action:
        events = events.filter(action=action)
    return events.order_by("-created_at", "-id")
