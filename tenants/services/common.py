"""What every write here shares: the audit event it records, limits applied to a tenant or key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ValidationError

from tenants.models import (
    AuditEvent,
    LimitFields,
    Tenant,
    User,
)


def audit_record(
    *,
    actor: User | None,
    tenant: Tenant | None,
    action: str,
    target: object,
    details: Mapping[str, Any] | None = None,
) -> AuditEvent:
    return AuditEvent.objects.create(
        tenant=tenant,
        actor=actor,
        actor_label=actor.get_username() if actor else "system",
        action=action,
        target_type=type(target).__name__.lower(),
        target_id=str(getattr(target, "pk", "") or ""),
        target_label=str(target)[:200],
        details=dict(details or {}),
    )


def apply_limits(obj: LimitFields, limits: Mapping[str, int | None]) -> dict[str, Any]:
    """Set the given limit fields (a tenant's quotas too); return {name: [old, new]} for those
    that changed."""
    changes: dict[str, Any] = {}
    known = LimitFields.LIMIT_NAMES + (Tenant.QUOTA_NAMES if isinstance(obj, Tenant) else ())
    for name, value in limits.items():
        if name not in known:
            raise ValidationError({name: "Unknown limit."})
        old = getattr(obj, name)
        if old != value:
            changes[name] = [old, value]
            setattr(obj, name, value)
    return changes
