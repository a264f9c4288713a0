"""Writes to tenants: created (with its owner), renamed or suspended, its limits and its response
cache (each change drops the tenant's cached keys, records an audit event)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from tenants.models import (
    Tenant,
    User,
)
from tenants.priority import DEFAULT_CLASS
from tenants.services.common import apply_limits, audit_record
from tenants.signals import keys_changed, response_cache_reset


def _tenant_changed(tenant: Tenant) -> None:
    """Status, weight and limits are cached with every key of the tenant: drop them all."""
    keys_changed.send(sender=Tenant, tenant_id=tenant.pk)


# --- Tenants -----------------------------------------------------------------------------


@transaction.atomic
def tenant_create(
    *,
    slug: str,
    name: str = "",
    weight: int = 1,
    priority_class: str = DEFAULT_CLASS,
    limits: Mapping[str, int | None] | None = None,
    actor: User | None,
) -> Tenant:
    tenant = Tenant(slug=slug, name=name or slug, weight=weight, priority_class=priority_class)
    apply_limits(tenant, limits or {})
    if Tenant.objects.filter(slug=slug).exists():
        raise ValidationError({"slug": f"A tenant with slug {slug!r} already exists."})
    tenant.full_clean()
    try:
        with transaction.atomic():
            tenant.save()
    except IntegrityError:  # lost a race with a concurrent create of the same slug
        raise ValidationError({"slug": f"A tenant with slug {slug!r} already exists."}) from None
    audit_record(
        actor=actor,
        tenant=tenant,
        action="tenant.create",
        target=tenant,
        details={"weight": weight, "priority_class": priority_class, "limits": tenant.limits()},
    )
    return tenant


def _tenant_save(
    tenant: Tenant, *, actor: User | None, action: str, changes: dict[str, Any]
) -> Tenant:
    """A changed tenant checked, saved, audited and dropped from the gateway's key caches."""
    if changes:
        tenant.full_clean()
        tenant.save()
        audit_record(actor=actor, tenant=tenant, action=action, target=tenant, details=changes)
        _tenant_changed(tenant)
    return tenant


def _set_given(tenant: Tenant, values: Mapping[str, Any]) -> dict[str, Any]:
    """Set the fields given (None: left alone); {name: [old, new]} for those that changed."""
    changes: dict[str, Any] = {}
    for field, value in values.items():
        if value is not None and getattr(tenant, field) != value:
            changes[field] = [getattr(tenant, field), value]
            setattr(tenant, field, value)
    return changes


@transaction.atomic
def tenant_update(
    *,
    tenant: Tenant,
    actor: User | None,
    name: str | None = None,
    status: str | None = None,
    weight: int | None = None,
    priority_class: str | None = None,
) -> Tenant:
    """Name, status, fair-share weight and priority class (the highest class its requests
    may run in; a key narrowed to a class above the new one runs in the new one)."""
    changes = _set_given(
        tenant,
        {"name": name, "status": status, "weight": weight, "priority_class": priority_class},
    )
    return _tenant_save(tenant, actor=actor, action="tenant.update", changes=changes)


@transaction.atomic
def tenant_limits_update(
    *, tenant: Tenant, actor: User | None, limits: Mapping[str, int | None]
) -> Tenant:
    changes = apply_limits(tenant, limits)
    return _tenant_save(tenant, actor=actor, action="tenant.limits", changes=changes)


@transaction.atomic
def tenant_cache_update(
    *,
    tenant: Tenant,
    actor: User | None,
    mode: str | None = None,
    ttl_seconds: int | None = None,
    threshold: float | None = None,
    embedding_model: str | None = None,
) -> Tenant:
    """The tenant's response cache: ``off``, ``exact`` or ``semantic``, how long an answer is
    kept, and for semantic its similarity threshold and embedding model. Every key of the
    tenant carries the policy to the gateway (dropped from its caches here)."""
    changes = _set_given(
        tenant,
        {
            "response_cache": mode,
            "response_cache_ttl_seconds": ttl_seconds,
            "response_cache_threshold": threshold,
            "response_cache_embedding_model": embedding_model,
        },
    )
    if threshold is not None and not math.isfinite(threshold):
        raise ValidationError({"threshold": "The threshold must be a number from 0.5 to 1."})
    if tenant.response_cache == Tenant.Cache.SEMANTIC and not tenant.response_cache_embedding_model:
        raise ValidationError(
            {"embedding_model": "The semantic cache needs an embedding model to embed with."}
        )
    if "response_cache" in changes:  # on or off: it starts empty
        response_cache_reset.send(sender=Tenant, tenant_id=tenant.pk)
    return _tenant_save(tenant, actor=actor, action="tenant.cache", changes=changes)
