"""Writes to API keys: issued (the secret shown once, kept hashed), revoked, rotated, their
limits, class and cache; their last use flushed from Redis."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from redis.exceptions import RedisError, ResponseError

from tenants.keys import (
    LAST_USED_SETS,
    LEGACY_LAST_USED_KEY,
    key_generate,
    last_used_key,
    last_used_tenants_key,
)
from tenants.models import (
    ApiKey,
    Tenant,
    User,
)
from tenants.priority import PRIORITY_CLASSES, band
from tenants.services.common import apply_limits, audit_record
from tenants.signals import keys_changed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IssuedKey:
    """A key just created: the only moment its secret exists outside the caller's hands."""

    api_key: ApiKey
    secret: str


# --- API keys --------------------------------------------------------------------------------


def _key_changed(api_key: ApiKey) -> None:
    """Tell every web process to drop what it cached about this key, once committed."""
    keys_changed.send(sender=ApiKey, prefix=api_key.prefix)


@transaction.atomic
def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    created_by: User | None,
    scopes: Sequence[str] | None = None,
    expires_at: datetime | None = None,
    limits: Mapping[str, int | None] | None = None,
    priority_class: str = "",
    rotated_from: ApiKey | None = None,
) -> IssuedKey:
    scopes = list(scopes) if scopes is not None else list(ApiKey.Scope.values)
    unknown = sorted(set(scopes) - set(ApiKey.Scope.values))
    if unknown or not scopes:
        raise ValidationError({"scopes": f"Choose one or more of {list(ApiKey.Scope.values)}."})
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": "Must be in the future."})
    full, prefix, digest = key_generate()
    api_key = ApiKey(
        tenant=tenant,
        name=name,
        prefix=prefix,
        secret_hash=digest,
        scopes=sorted(set(scopes)),
        created_by=created_by,
        expires_at=expires_at,
        rotated_from=rotated_from,
    )
    apply_limits(api_key, limits or {})
    api_key.priority_class = _key_class_checked(tenant, priority_class)
    api_key.full_clean()
    api_key.save()
    audit_record(
        actor=created_by,
        tenant=tenant,
        action="api_key.create",
        target=api_key,
        details={"name": name, "scopes": api_key.scopes, "prefix": prefix},
    )
    return IssuedKey(api_key=api_key, secret=full)


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey, actor: User | None) -> ApiKey:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
        audit_record(
            actor=actor,
            tenant=api_key.tenant,
            action="api_key.revoke",
            target=api_key,
            details={"prefix": api_key.prefix},
        )
        _key_changed(api_key)
    return api_key


@transaction.atomic
def api_key_rotate(
    *, api_key: ApiKey, actor: User | None, grace_seconds: int | None = None
) -> IssuedKey:
    """A new key with the same name, scopes and limits; the old one expires after the grace."""
    if not api_key.is_active:
        raise ValidationError({"key": "Only an active key can be rotated."})
    if hasattr(api_key, "rotated_to"):
        raise ValidationError({"key": "This key was already rotated."})
    grace = (
        settings.INFERPLANE_KEY_ROTATION_GRACE_SECONDS if grace_seconds is None else grace_seconds
    )
    issued = api_key_create(
        tenant=api_key.tenant,
        name=api_key.name,
        created_by=actor,
        scopes=api_key.scopes,
        expires_at=api_key.expires_at,
        limits=api_key.limits(),
        priority_class=api_key.priority_class,
        rotated_from=api_key,
    )
    if not api_key.use_response_cache:  # the new key keeps the old one's choice
        issued.api_key.use_response_cache = False
        issued.api_key.save(update_fields=["use_response_cache"])
    old_expiry = api_key.expires_at
    new_expiry = timezone.now() + timedelta(seconds=grace)
    if old_expiry is None or new_expiry < old_expiry:
        api_key.expires_at = new_expiry
        api_key.save(update_fields=["expires_at"])
    audit_record(
        actor=actor,
        tenant=api_key.tenant,
        action="api_key.rotate",
        target=api_key,
        details={
            "prefix": api_key.prefix,
            "new_prefix": issued.api_key.prefix,
            "old_key_expires_at": api_key.expires_at.isoformat() if api_key.expires_at else None,
        },
    )
    _key_changed(api_key)
    return issued


@transaction.atomic
def api_key_limits_update(
    *, api_key: ApiKey, actor: User | None, limits: Mapping[str, int | None]
) -> ApiKey:
    changes = apply_limits(api_key, limits)
    if changes:
        api_key.full_clean()
        api_key.save()
        audit_record(
            actor=actor,
            tenant=api_key.tenant,
            action="api_key.limits",
            target=api_key,
            details=changes,
        )
        _key_changed(api_key)
    return api_key


def _key_class_checked(tenant: Tenant, priority_class: str) -> str:
    """A key's class: blank (its tenant's) or one no higher than its tenant's."""
    if priority_class and (
        priority_class not in PRIORITY_CLASSES or band(priority_class) < band(tenant.priority_class)
    ):
        allowed = PRIORITY_CLASSES[band(tenant.priority_class) :]
        raise ValidationError(
            {
                "priority_class": f"A key of tenant {tenant.slug} may be narrowed to "
                f"{', '.join(allowed)}, or left blank for the tenant's "
                f"({tenant.priority_class})."
            }
        )
    return priority_class


@transaction.atomic
def api_key_priority_update(*, api_key: ApiKey, actor: User | None, priority_class: str) -> ApiKey:
    """The class the key's requests run in: blank for its tenant's, or a lower one."""
    priority_class = _key_class_checked(api_key.tenant, priority_class)
    if api_key.priority_class != priority_class:
        audit_record(
            actor=actor,
            tenant=api_key.tenant,
            action="api_key.priority",
            target=api_key,
            details={"priority_class": [api_key.priority_class, priority_class]},
        )
        api_key.priority_class = priority_class
        api_key.save(update_fields=["priority_class"])
        _key_changed(api_key)
    return api_key


@transaction.atomic
def api_key_cache_update(*, api_key: ApiKey, actor: User | None, enabled: bool) -> ApiKey:
    """Whether the key's requests use its tenant's response cache (when the tenant has one)."""
    if api_key.use_response_cache != enabled:
        audit_record(
            actor=actor,
            tenant=api_key.tenant,
            action="api_key.cache",
            target=api_key,
            details={"use_response_cache": [api_key.use_response_cache, enabled]},
        )
        api_key.use_response_cache = enabled
        api_key.save(update_fields=["use_response_cache"])
        _key_changed(api_key)
    return api_key


def api_keys_last_used_flush() -> int:
    """Copy the gateway's "last used" stamps (kept in Redis, off the request path) to keys."""
    from datetime import UTC

    from controlplane.redis import redis_sync, state_is_cluster

    client = redis_sync()
    stamps: dict[str, int] = {}
    if not state_is_cluster():
        # The one hash of the versions before the per-tenant ones (an upgrade's leftovers).
        stamps.update(_last_used_take(client, LEGACY_LAST_USED_KEY))
    # A tenant is named to its set by each request's end; one taken off it here whose hash
    # a request stamps after the rename below is named again by that request.
    for index in range(LAST_USED_SETS):
        named = last_used_tenants_key(index)
        while tenants := cast(list[bytes], client.spop(named, 1000)):
            try:
                for tenant_id in tenants:
                    stamps.update(_last_used_take(client, last_used_key(int(tenant_id))))
            except RedisError:
                logger.warning("could not flush the keys' last use: trying again next time")
                with contextlib.suppress(RedisError):
                    client.sadd(named, *tenants)
                break
    for prefix, stamp in stamps.items():
        ApiKey.objects.filter(prefix=prefix).update(
            last_used_at=datetime.fromtimestamp(stamp, tz=UTC)
        )
    return len(stamps)


def _last_used_take(client: Any, hashed: str) -> dict[str, int]:
    """The stamps of one last-use hash, taken off Redis (renamed in its own slot first, so
    that stamps written meanwhile go to a new hash)."""
    staging = hashed + ":flushing"
    try:
        client.rename(hashed, staging)
    except ResponseError:  # no such key: nothing to flush
        return {}
    held = cast(dict[bytes, bytes], client.hgetall(staging))
    client.delete(staging)
    return {k.decode(): int(v) for k, v in held.items()}
