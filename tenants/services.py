"""Writes. Every change to tenants, members, keys or limits records an audit event."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.files import File
from django.core.files.storage import default_storage
from django.db import IntegrityError, transaction
from django.db.models import Count, Max, Q, Sum
from django.utils import timezone

from inference.models import Model
from tenants import lora
from tenants.access import ROLE_PERMS, Perm
from tenants.keys import key_generate
from tenants.models import (
    Adapter,
    ApiKey,
    AuditEvent,
    Invitation,
    LimitFields,
    Membership,
    Role,
    Tenant,
    User,
    adapter_name_validator,
)

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
    """Set the given limit fields; return {name: [old, new]} for those that changed."""
    changes: dict[str, Any] = {}
    for name, value in limits.items():
        if name not in LimitFields.LIMIT_NAMES:
            raise ValidationError({name: "Unknown limit."})
        old = getattr(obj, name)
        if old != value:
            changes[name] = [old, value]
            setattr(obj, name, value)
    return changes


def _tenant_changed(tenant: Tenant) -> None:
    """Status, weight and limits are cached with every key of the tenant: drop them all."""
    from inference.keycache import keycache_invalidate

    keycache_invalidate(tenant_id=tenant.pk)


# --- Tenants -----------------------------------------------------------------------------


@transaction.atomic
def tenant_create(
    *,
    slug: str,
    name: str = "",
    weight: int = 1,
    limits: Mapping[str, int | None] | None = None,
    actor: User | None,
) -> Tenant:
    tenant = Tenant(slug=slug, name=name or slug, weight=weight)
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
        details={"weight": weight, "limits": tenant.limits()},
    )
    return tenant


@transaction.atomic
def tenant_update(
    *,
    tenant: Tenant,
    actor: User | None,
    name: str | None = None,
    status: str | None = None,
    weight: int | None = None,
) -> Tenant:
    changes: dict[str, Any] = {}
    for field, value in (("name", name), ("status", status), ("weight", weight)):
        if value is not None and getattr(tenant, field) != value:
            changes[field] = [getattr(tenant, field), value]
            setattr(tenant, field, value)
    if changes:
        tenant.full_clean()
        tenant.save()
        audit_record(
            actor=actor, tenant=tenant, action="tenant.update", target=tenant, details=changes
        )
        _tenant_changed(tenant)
    return tenant


@transaction.atomic
def tenant_limits_update(
    *, tenant: Tenant, actor: User | None, limits: Mapping[str, int | None]
) -> Tenant:
    changes = _apply_limits(tenant, limits)
    if changes:
        tenant.full_clean()
        tenant.save()
        audit_record(
            actor=actor, tenant=tenant, action="tenant.limits", target=tenant, details=changes
        )
        _tenant_changed(tenant)
    return tenant


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
    from inference.keycache import keycache_invalidate

    keycache_invalidate(prefix=api_key.prefix)


@transaction.atomic
def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    created_by: User | None,
    scopes: Sequence[str] | None = None,
    expires_at: datetime | None = None,
    limits: Mapping[str, int | None] | None = None,
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
        rotated_from=api_key,
    )
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


def api_keys_last_used_flush() -> int:
    """Copy the gateway's "last used" stamps (kept in Redis, off the request path) to keys."""
    from datetime import UTC

    from controlplane.redis import redis_sync

    client = redis_sync()
    staging = "ip:key_last_used:flushing"
    try:
        client.rename("ip:key_last_used", staging)
    except Exception:  # nothing to flush (no such key)
        return 0
    stamps = {k.decode(): int(v) for k, v in client.hgetall(staging).items()}  # type: ignore[union-attr]
    client.delete(staging)
    for prefix, stamp in stamps.items():
        ApiKey.objects.filter(prefix=prefix).update(
            last_used_at=datetime.fromtimestamp(stamp, tz=UTC)
        )
    return len(stamps)


# --- LoRA adapters -------------------------------------------------------------------------------

ADAPTER_PARTS = ("archive", "adapter_config", "adapter_model")


def _adapter_staging() -> str:
    return f"adapter-uploads/{uuid.uuid4().hex}/"


@transaction.atomic
def adapter_upload(
    *, tenant: Tenant, name: str, files: Mapping[str, File[Any]], actor: User | None
) -> Adapter:
    """Take an upload (an ``archive``, or ``adapter_config`` + ``adapter_model``) into staging
    and queue its validation. The new version is ``validating`` until then."""
    if set(files) not in ({"archive"}, {"adapter_config", "adapter_model"}):
        raise ValidationError(
            {
                "files": "Send either one archive (.zip or .tar.gz) or both adapter_config "
                "(adapter_config.json) and adapter_model (adapter_model.safetensors)."
            }
        )
    adapter_name_validator(name)
    # The tenant's row lock puts versions in order and makes the quota check exact.
    Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
    latest = Adapter.objects.filter(tenant=tenant, name=name).aggregate(v=Max("version"))["v"]
    size = sum(upload.size or 0 for upload in files.values())
    _adapter_quota_check(tenant=tenant, size=size)
    staging = _adapter_staging()
    try:
        for part, upload in files.items():
            default_storage.save(staging + part, upload)
    except Exception:
        with contextlib.suppress(Exception):  # what reached the storage before it failed
            _storage_remove(staging)
        raise
    adapter = Adapter.objects.create(
        tenant=tenant,
        name=name,
        version=(latest or 0) + 1,
        staging_path=staging,
        size_bytes=size,
        created_by=actor,
    )
    audit_record(
        actor=actor,
        tenant=tenant,
        action="adapter.upload",
        target=adapter,
        details={"name": name, "version": adapter.version, "bytes": size},
    )
    from tenants.tasks import adapter_validate_task

    transaction.on_commit(lambda: adapter_validate_task.delay(adapter.pk))
    return adapter


def _adapter_quota_check(*, tenant: Tenant, size: int) -> None:
    """Refuse an upload that would take the tenant past its adapter quota. Every version not
    deleted counts, rejected ones too (they stay listed until deleted), but only the bytes
    kept count: a ready version's stored files, a validating one's staged upload."""
    held = Adapter.objects.filter(tenant=tenant, deleted_at__isnull=True).aggregate(
        versions=Count("pk"),
        bytes=Sum("size_bytes", filter=~Q(status=Adapter.Status.REJECTED), default=0),
    )
    max_versions = settings.ADAPTER_MAX_VERSIONS_PER_TENANT
    if held["versions"] >= max_versions:
        raise ValidationError(
            {
                "non_field_errors": f"{tenant.name} already keeps {held['versions']:,} adapter "
                f"versions, the most allowed ({max_versions:,}). Delete versions no longer "
                "needed (rejected ones count too), then upload again."
            }
        )
    max_bytes = settings.ADAPTER_MAX_BYTES_PER_TENANT
    if held["bytes"] + size > max_bytes:
        raise ValidationError(
            {
                "non_field_errors": f"This upload ({size:,} bytes) would bring {tenant.name}'s "
                f"adapters to {held['bytes'] + size:,} bytes, over the quota of "
                f"{max_bytes:,} bytes. Delete versions no longer needed, then upload again."
            }
        )


def _staged_copy(staging: str, workdir: Path) -> dict[str, Path]:
    """The staged upload as local files (storage may be S3), archives unpacked safely."""
    local: dict[str, Path] = {}
    for part in ADAPTER_PARTS:
        if default_storage.exists(staging + part):
            target = workdir / part
            with default_storage.open(staging + part, "rb") as src, target.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            local[part] = target
    if "archive" in local:
        out_dir = workdir / "unpacked"
        out_dir.mkdir()
        return lora.unpack(local["archive"], out_dir, max_bytes=settings.ADAPTER_MAX_BYTES)
    return {lora.CONFIG: local["adapter_config"], lora.WEIGHTS: local["adapter_model"]}


def adapter_validate(*, adapter_id: int) -> Adapter:
    """Check the staged upload against the base models that serve LoRA; keep it
    content-addressed if it passes. Either way the staging area is emptied.

    Content that cannot be served ends here, rejected with the reason. Anything else
    (storage unreachable, database gone) raises and keeps the staging area, so that the
    task can run again; it gives up after a bounded number of tries (``adapter_reject``).
    """
    adapter = Adapter.objects.select_related("tenant").get(pk=adapter_id)
    if adapter.status != Adapter.Status.VALIDATING:
        return adapter
    staging = adapter.staging_path
    with tempfile.TemporaryDirectory(prefix="adapter-") as tmp:
        try:
            files = _staged_copy(staging, Path(tmp))
            model, info = _validate_against_models(files)
        except lora.Rejected as exc:
            return adapter_reject(adapter_id=adapter.pk, reason=str(exc))
        digest = hashlib.sha256()
        for part in (lora.CONFIG, lora.WEIGHTS):
            with files[part].open("rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        sha = digest.hexdigest()
        home = f"adapters/{sha}/"
        for part in (lora.CONFIG, lora.WEIGHTS):
            if not default_storage.exists(home + part):
                with files[part].open("rb") as f:
                    default_storage.save(home + part, File(f))
    size = sum(default_storage.size(home + p) for p in (lora.CONFIG, lora.WEIGHTS))
    with transaction.atomic():
        # Deleted, or given up on by the sweep, while it was being validated: keep nothing
        # (and never bring it back).
        adapter = Adapter.objects.select_for_update().select_related("tenant").get(pk=adapter.pk)
        if adapter.deleted_at is not None or adapter.status != Adapter.Status.VALIDATING:
            if adapter.status == Adapter.Status.VALIDATING:
                adapter.status = Adapter.Status.REJECTED
                adapter.reason = "Deleted while it was being validated."
                adapter.validated_at = timezone.now()
                adapter.save(update_fields=_VERDICT_FIELDS)
            gone = adapter

            def discard() -> None:
                _staging_discard(gone)
                _files_unshared(sha)

            transaction.on_commit(discard)
            return adapter
        adapter.status = Adapter.Status.READY
        adapter.sha256 = sha
        adapter.base_model = model
        adapter.rank, adapter.alpha = info.rank, info.alpha
        adapter.target_modules = list(info.target_modules)
        adapter.size_bytes = size
        adapter.validated_at = timezone.now()
        adapter.save(
            update_fields=[
                *_VERDICT_FIELDS,
                "sha256",
                "base_model",
                "rank",
                "alpha",
                "target_modules",
                "size_bytes",
            ]
        )
    audit_record(
        actor=None,
        tenant=adapter.tenant,
        action="adapter.ready",
        target=adapter,
        details={"sha256": sha, "rank": info.rank, "base_model": model.name},
    )
    _staging_discard(adapter)
    from inference.catalog import catalog_publish

    transaction.on_commit(catalog_publish)  # servable from now on
    return adapter


def _validate_against_models(files: dict[str, Path]) -> tuple[Model, lora.AdapterInfo]:
    candidates = [m for m in Model.objects.filter(supports_lora=True) if m.architecture]
    if not candidates:
        raise lora.Rejected("No model served here accepts LoRA adapters.")
    problems = []
    for model in candidates:
        pools = list(model.pools.all())
        max_rank = min((p.max_lora_rank for p in pools), default=8)
        names = [model.name, model.served_name, str(model.architecture.get("_name_or_path", ""))]
        try:
            info = lora.validate(
                files,
                base_names=[n for n in names if n],
                max_rank=max_rank,
                arch=lora.Architecture.from_config(model.architecture),
            )
            return model, info
        except lora.Rejected as exc:
            problems.append(str(exc))
    raise lora.Rejected(problems[0])


# Not deleted_at (a delete meanwhile stands), nor staging_path: it is cleared once the
# staging area is really gone (``_staging_discard``).
_VERDICT_FIELDS = ["status", "reason", "validated_at"]


def adapter_reject(*, adapter_id: int, reason: str) -> Adapter:
    """The verdict for a version that will not be served, with ``reason`` for the person who
    uploaded it; its staging area goes. A version that already has a verdict keeps it."""
    with transaction.atomic():
        adapter = Adapter.objects.select_for_update().select_related("tenant").get(pk=adapter_id)
        if adapter.status != Adapter.Status.VALIDATING:
            return adapter
        adapter.status = Adapter.Status.REJECTED
        adapter.reason = reason[:500]
        adapter.validated_at = timezone.now()
        adapter.save(update_fields=_VERDICT_FIELDS)
        audit_record(
            actor=None,
            tenant=adapter.tenant,
            action="adapter.rejected",
            target=adapter,
            details={"reason": adapter.reason},
        )
    _staging_discard(adapter)
    return adapter


def adapters_stuck_reject() -> int:
    """The periodic sweep: reject the versions still ``validating`` after
    ADAPTER_VALIDATION_DEADLINE_MINUTES (a worker killed at the hard time limit or lost, a
    task message lost with Redis), and empty the staging areas that storage failed to give
    up at the verdict. Returns how many versions it rejected."""
    minutes = settings.ADAPTER_VALIDATION_DEADLINE_MINUTES
    stuck = list(
        Adapter.objects.filter(
            status=Adapter.Status.VALIDATING,
            created_at__lt=timezone.now() - timedelta(minutes=minutes),
        ).values_list("pk", flat=True)
    )
    for adapter_id in stuck:
        adapter_reject(
            adapter_id=adapter_id,
            reason=f"Validation did not finish within {minutes} minutes (not because of the "
            "adapter); upload it again.",
        )
    leftovers = Adapter.objects.exclude(status=Adapter.Status.VALIDATING).exclude(staging_path="")
    for adapter in leftovers[:500]:
        _staging_discard(adapter)
    return len(stuck)


def _staging_discard(adapter: Adapter) -> None:
    """Empty a version's staging area once it has a verdict. Storage that fails now leaves
    ``staging_path`` set, for the periodic sweep to try again."""
    staging = adapter.staging_path
    if not staging:
        return
    try:
        _storage_remove(staging)
    except Exception:
        logger.warning("adapter %s: staging %s not removed", adapter.pk, staging, exc_info=True)
        return
    Adapter.objects.filter(pk=adapter.pk, staging_path=staging).update(staging_path="")
    adapter.staging_path = ""


def _storage_remove(prefix: str) -> None:
    if not prefix:
        return
    dirs, files = default_storage.listdir(prefix) if default_storage.exists(prefix) else ([], [])
    for name in files:
        default_storage.delete(prefix + name)
    for name in dirs:
        _storage_remove(f"{prefix}{name}/")
    with contextlib.suppress(OSError, NotImplementedError):
        default_storage.delete(prefix.rstrip("/"))


RETIRE_AFTER_SECONDS = 3


@transaction.atomic
def adapter_delete(*, adapter: Adapter, actor: User | None) -> Adapter:
    """Delete one version. Its files go when no other adapter (any tenant) shares them."""
    adapter = Adapter.objects.select_for_update().get(pk=adapter.pk)
    if adapter.deleted_at:
        return adapter
    adapter.deleted_at = timezone.now()
    adapter.save(update_fields=["deleted_at"])
    audit_record(actor=actor, tenant=adapter.tenant, action="adapter.delete", target=adapter)
    if adapter.status == Adapter.Status.READY:
        # Gateways stop routing to it within a second; the task unloads it from the engines
        # and removes its files once no running request uses it.
        from inference.catalog import catalog_publish
        from inference.tasks import adapter_retire_task

        transaction.on_commit(catalog_publish)
        # After the gateways' next catalog refresh (1 s): no new request can pick it then.
        transaction.on_commit(
            lambda: adapter_retire_task.apply_async((adapter.pk,), countdown=RETIRE_AFTER_SECONDS)
        )
    return adapter


def adapter_files_remove(*, adapter: Adapter) -> None:
    """Remove a deleted adapter's files, unless another live adapter (any tenant, same
    content) shares them."""
    _files_unshared(adapter.sha256)


def _files_unshared(sha: str) -> None:
    if sha and not Adapter.objects.filter(sha256=sha, deleted_at__isnull=True).exists():
        _storage_remove(f"adapters/{sha}/")
        shutil.rmtree(Path(settings.ADAPTER_CACHE_DIR) / sha, ignore_errors=True)


def adapter_local_dir(*, adapter: Adapter) -> str:
    """A directory holding a ready adapter's two files on this machine's filesystem: what an
    engine's ``load_lora_adapter`` takes as ``lora_path`` (engines must see the same path).

    With filesystem storage, where the storage keeps them. With storage that has no local
    paths (S3), a copy in ``ADAPTER_CACHE_DIR`` (a volume shared with the engines), fetched
    from storage once, content-addressed like the storage itself.
    """
    home = f"adapters/{adapter.sha256}/"
    with contextlib.suppress(NotImplementedError):
        local = Path(default_storage.path(home.rstrip("/")))
        if all((local / part).is_file() for part in (lora.CONFIG, lora.WEIGHTS)):
            return str(local)
    cache = Path(settings.ADAPTER_CACHE_DIR) / adapter.sha256
    if not all((cache / part).is_file() for part in (lora.CONFIG, lora.WEIGHTS)):
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{adapter.sha256}-", dir=cache.parent))
        try:
            for part in (lora.CONFIG, lora.WEIGHTS):
                with (
                    default_storage.open(home + part, "rb") as src,
                    (staging / part).open("wb") as out,
                ):
                    shutil.copyfileobj(src, out, 1 << 20)
            with contextlib.suppress(OSError):  # another process filled it meanwhile: fine
                staging.rename(cache)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(cache)
