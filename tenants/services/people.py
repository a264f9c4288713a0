"""Writes to a tenant's members and invitations: the owner rules (an owner never left without
another), roles, invitation links (hashed; what the inviter may still grant)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from tenants.access import ROLE_PERMS, Perm
from tenants.models import (
    Invitation,
    Membership,
    Role,
    Tenant,
    User,
)
from tenants.services.common import audit_record

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
