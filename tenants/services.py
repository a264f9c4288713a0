"""Writes. Every change to tenants, members, keys or limits records an audit event."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone
from redis.exceptions import RedisError, ResponseError

from tenants.access import ROLE_PERMS, Perm
from tenants.keys import (
    LAST_USED_SETS,
    LEGACY_LAST_USED_KEY,
    key_generate,
    last_used_key,
    last_used_tenants_key,
)
from tenants.models import (
    ApiKey,
    AuditEvent,
    Invitation,
    LimitFields,
    Membership,
    Role,
    Tenant,
    User,
)
from tenants.priority import DEFAULT_CLASS, PRIORITY_CLASSES, band
from tenants.signals import keys_changed, response_cache_reset

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IssuedKey:
    """A key just created: the only moment its secret exists outside the caller's hands."""

    api_key: ApiKey
    secret: str


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


def _apply_limits(obj: LimitFields, limits: Mapping[str, int | None]) -> dict[str, Any]:
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
    _apply_limits(tenant, limits or {})
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
    changes = _apply_limits(tenant, limits)
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


# --- Members ---------------------------------------------------------------------------------


def _check_owner_rules(*, actor_role: str | None, roles_touched: Sequence[str]) -> None:
    """Only owners (and staff, who pass actor_role=None) grant, change or remove owners."""
    if actor_role is not None and actor_role != Role.OWNER and Role.OWNER in roles_touched:
        raise PermissionDenied("Only an owner can grant, change or remove the owner role.")


@transaction.atomic
def membership_add(
    *, tenant: Tenant, user: User, role: str, actor: User | None, actor_role: str | None
) -> Membership:
    """For commands and platform code (``seed_demo``). People join a tenant only by
    accepting an invitation (``invitation_accept``): nobody is added behind their back."""
    _check_owner_rules(actor_role=actor_role, roles_touched=[role])
    if Membership.objects.filter(tenant=tenant, user=user).exists():
        raise ValidationError({"user": f"{user.get_username()} is already a member."})
    membership = Membership(tenant=tenant, user=user, role=role)
    membership.full_clean(validate_unique=False)
    membership.save()
    audit_record(
        actor=actor,
        tenant=tenant,
        action="member.add",
        target=membership,
        details={"user": user.get_username(), "role": role},
    )
    return membership


def _lock_owners(tenant: Tenant) -> int:
    """Count owners under a row lock, so two concurrent removals cannot both pass."""
    return len(
        Membership.objects.select_for_update().filter(tenant=tenant, role=Role.OWNER).values("id")
    )


@transaction.atomic
def membership_change_role(
    *, membership: Membership, role: str, actor: User | None, actor_role: str | None
) -> Membership:
    old = membership.role
    if old == role:
        return membership
    _check_owner_rules(actor_role=actor_role, roles_touched=[old, role])
    if old == Role.OWNER and _lock_owners(membership.tenant) <= 1:
        raise ValidationError({"role": "A tenant must keep at least one owner."})
    membership.role = role
    membership.full_clean(validate_unique=False)
    membership.save(update_fields=["role"])
    audit_record(
        actor=actor,
        tenant=membership.tenant,
        action="member.role",
        target=membership,
        details={"user": membership.user.get_username(), "role": [old, role]},
    )
    _invitations_revoke_ungrantable(
        tenant=membership.tenant, inviter=membership.user, role=role, actor=actor
    )
    return membership


@transaction.atomic
def membership_remove(
    *, membership: Membership, actor: User | None, actor_role: str | None
) -> None:
    _check_owner_rules(actor_role=actor_role, roles_touched=[membership.role])
    if membership.role == Role.OWNER and _lock_owners(membership.tenant) <= 1:
        raise ValidationError({"role": "The last owner cannot be removed."})
    audit_record(
        actor=actor,
        tenant=membership.tenant,
        action="member.remove",
        target=membership,
        details={"user": membership.user.get_username(), "role": membership.role},
    )
    _invitations_revoke_ungrantable(
        tenant=membership.tenant, inviter=membership.user, role=None, actor=actor
    )
    membership.delete()


# --- Invitations -----------------------------------------------------------------------------

INVITATION_DAYS = 7


@dataclass(frozen=True)
class IssuedInvitation:
    """An invitation just created: the only moment its token exists outside the link."""

    invitation: Invitation
    token: str


def _invitation_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


INVITATION_INVALID = "This invitation link is no longer valid (used, revoked or expired)."
INVITER_GONE = "This invitation link is no longer valid: whoever sent it may no longer invite."


def _roles_grantable(role: str | None) -> frozenset[str]:
    """The roles a member with ``role`` may invite to (None: not a member, so none)."""
    if role is None or Perm.MEMBERS_MANAGE not in ROLE_PERMS[role]:
        return frozenset()
    if role == Role.OWNER:
        return frozenset(Role.values)
    return frozenset(Role.values) - {Role.OWNER}


def _inviter_may_grant(invitation: Invitation) -> bool:
    """Whether whoever created ``invitation`` may still invite someone with its role: an
    active staff member, or a member whose role may grant it. An invitation speaks for its
    sender, so it is worth no more than the sender's own rights now."""
    inviter = invitation.created_by
    if inviter is None or not inviter.is_active:
        return False
    if inviter.is_staff:
        return True
    role = (
        Membership.objects.filter(tenant_id=invitation.tenant_id, user=inviter)
        .values_list("role", flat=True)
        .first()
    )
    return invitation.role in _roles_grantable(role)


def _invitations_revoke_ungrantable(
    *, tenant: Tenant, inviter: User, role: str | None, actor: User | None
) -> None:
    """Revoke the open invitations ``inviter`` sent that their new ``role`` (None: they
    left or were removed) may no longer grant. Staff invite as staff: theirs stay."""
    if inviter.is_staff:
        return
    now = timezone.now()
    pending = (
        Invitation.objects.select_for_update()
        .filter(
            tenant=tenant,
            created_by=inviter,
            accepted_at__isnull=True,
            revoked_at__isnull=True,
            expires_at__gt=now,
        )
        .exclude(role__in=_roles_grantable(role))
    )
    for invitation in pending:
        invitation.revoked_at = now
        invitation.save(update_fields=["revoked_at"])
        audit_record(
            actor=actor,
            tenant=tenant,
            action="invitation.revoke",
            target=invitation,
            details={
                "role": invitation.role,
                "reason": "inviter removed" if role is None else f"inviter now {role}",
            },
        )


@transaction.atomic
def invitation_create(
    *, tenant: Tenant, role: str, actor: User | None, actor_role: str | None
) -> IssuedInvitation:
    _check_owner_rules(actor_role=actor_role, roles_touched=[role])
    if role not in Role.values:
        raise ValidationError({"role": f"Choose one of {', '.join(Role.values)}."})
    token = secrets.token_urlsafe(32)
    invitation = Invitation.objects.create(
        tenant=tenant,
        role=role,
        token_hash=_invitation_digest(token),
        created_by=actor,
        expires_at=timezone.now() + timedelta(days=INVITATION_DAYS),
    )
    audit_record(
        actor=actor,
        tenant=tenant,
        action="invitation.create",
        target=invitation,
        details={"role": role},
    )
    return IssuedInvitation(invitation=invitation, token=token)


def invitation_find(*, token: str) -> Invitation | None:
    """The open invitation a link carries, if any (used, revoked, expired, made up, or sent
    by someone who may no longer invite: None)."""
    invitation = (
        Invitation.objects.select_related("tenant")
        .filter(token_hash=_invitation_digest(token))
        .first()
    )
    if invitation is None or not invitation.is_open or not _inviter_may_grant(invitation):
        return None
    return invitation


@transaction.atomic
def invitation_accept(*, token: str, user: User) -> Membership:
    """Use the link: ``user`` joins with the invited role. A link works once."""
    invitation = (
        Invitation.objects.select_for_update()
        .select_related("tenant")
        .filter(token_hash=_invitation_digest(token))
        .first()
    )
    if invitation is None or not invitation.is_open:
        raise ValidationError(INVITATION_INVALID)
    if not _inviter_may_grant(invitation):
        raise ValidationError(INVITER_GONE)
    if Membership.objects.filter(tenant=invitation.tenant, user=user).exists():
        raise ValidationError(f"You are already a member of {invitation.tenant.name}.")
    membership = Membership.objects.create(
        tenant=invitation.tenant, user=user, role=invitation.role
    )
    invitation.accepted_at = timezone.now()
    invitation.accepted_by = user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    audit_record(
        actor=user,
        tenant=invitation.tenant,
        action="member.join",
        target=membership,
        details={"user": user.get_username(), "role": invitation.role},
    )
    return membership


@transaction.atomic
def invitation_revoke(*, invitation: Invitation, actor: User | None) -> Invitation:
    if invitation.revoked_at is None and invitation.accepted_at is None:
        invitation.revoked_at = timezone.now()
        invitation.save(update_fields=["revoked_at"])
        audit_record(
            actor=actor, tenant=invitation.tenant, action="invitation.revoke", target=invitation
        )
    return invitation


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
    _apply_limits(api_key, limits or {})
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
    changes = _apply_limits(api_key, limits)
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
