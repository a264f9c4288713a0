"""Writes. Every change to tenants, members, keys or limits records an audit event. One module
per concern: ``tenancy`` (tenants), ``people`` (members and invitations), ``api_keys``,
``common`` (the audit event, limits applied). Callers import from here."""

from tenants.services.api_keys import (
    IssuedKey,
    api_key_cache_update,
    api_key_create,
    api_key_limits_update,
    api_key_priority_update,
    api_key_revoke,
    api_key_rotate,
    api_keys_last_used_flush,
)
from tenants.services.common import audit_record
from tenants.services.people import (
    INVITATION_DAYS,
    INVITATION_INVALID,
    INVITER_GONE,
    IssuedInvitation,
    invitation_accept,
    invitation_create,
    invitation_find,
    invitation_revoke,
    membership_add,
    membership_change_role,
    membership_remove,
)
from tenants.services.tenancy import (
    tenant_cache_update,
    tenant_create,
    tenant_limits_update,
    tenant_update,
)

__all__ = [
    "INVITATION_DAYS",
    "INVITATION_INVALID",
    "INVITER_GONE",
    "IssuedInvitation",
    "IssuedKey",
    "api_key_cache_update",
    "api_key_create",
    "api_key_limits_update",
    "api_key_priority_update",
    "api_key_revoke",
    "api_key_rotate",
    "api_keys_last_used_flush",
    "audit_record",
    "invitation_accept",
    "invitation_create",
    "invitation_find",
    "invitation_revoke",
    "membership_add",
    "membership_change_role",
    "membership_remove",
    "tenant_cache_update",
    "tenant_create",
    "tenant_limits_update",
    "tenant_update",
]
