"""Who may do what inside a tenant.

Platform staff (``is_staff``) may do everything everywhere; tenant members by role. Views ask
``tenant_access_get`` for the tenant and the caller's permissions; a caller who is not a
member (and not staff) is told the tenant does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tenants.models import Role, Tenant


class Perm(StrEnum):
    VIEW = "view"  # tenant, limits, members, key list (prefixes only)
    MEMBERS_MANAGE = "members.manage"
    KEYS_CREATE = "keys.create"
    KEYS_MANAGE_ANY = "keys.manage_any"  # revoke/rotate keys created by others
    KEY_LIMITS_EDIT = "keys.limits"
    AUDIT_VIEW = "audit.view"
    BILLING_VIEW = "billing.view"
    ADAPTERS_MANAGE = "adapters.manage"  # upload and delete LoRA adapters
    BATCHES_MANAGE = "batches.manage"  # see batches' results, cancel batches
    MODERATION_MANAGE = "moderation.manage"  # the moderation policy
    CACHE_MANAGE = "cache.manage"  # the response cache: on or off, its TTL, a purge
    PLATFORM = "platform"  # tenant status, weight and tenant limits: operators only


ROLE_PERMS: dict[str, frozenset[Perm]] = {
    Role.OWNER: frozenset(
        {
            Perm.VIEW,
            Perm.MEMBERS_MANAGE,
            Perm.KEYS_CREATE,
            Perm.KEYS_MANAGE_ANY,
            Perm.KEY_LIMITS_EDIT,
            Perm.AUDIT_VIEW,
            Perm.BILLING_VIEW,
            Perm.ADAPTERS_MANAGE,
            Perm.BATCHES_MANAGE,
            Perm.MODERATION_MANAGE,
            Perm.CACHE_MANAGE,
        }
    ),
    Role.ADMIN: frozenset(
        {
            Perm.VIEW,
            Perm.MEMBERS_MANAGE,
            Perm.KEYS_CREATE,
            Perm.KEYS_MANAGE_ANY,
            Perm.KEY_LIMITS_EDIT,
            Perm.AUDIT_VIEW,
            Perm.BILLING_VIEW,
            Perm.ADAPTERS_MANAGE,
            Perm.BATCHES_MANAGE,
            Perm.MODERATION_MANAGE,
            Perm.CACHE_MANAGE,
        }
    ),
    Role.DEVELOPER: frozenset(
        {Perm.VIEW, Perm.KEYS_CREATE, Perm.ADAPTERS_MANAGE, Perm.BATCHES_MANAGE}
    ),
    Role.FINANCE: frozenset({Perm.VIEW, Perm.BILLING_VIEW}),
    Role.VIEWER: frozenset({Perm.VIEW}),
}
STAFF_PERMS = frozenset(Perm)


@dataclass(frozen=True)
class TenantAccess:
    tenant: Tenant
    role: str | None  # None for staff who are not members
    perms: frozenset[Perm]
    is_staff: bool

    def can(self, perm: Perm) -> bool:
        return perm in self.perms
