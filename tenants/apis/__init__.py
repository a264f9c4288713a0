"""Control API for tenants, members, API keys, limits and the audit log.

One view per operation (HackSoft style): parse, check access, call one service, serialize.
One module per concern: ``tenancy``, ``people`` (members, invitations, me), ``api_keys``,
``audit``, ``limits`` (the shapes tenants and keys share).
"""

from tenants.apis.api_keys import (
    ApiKeyCacheUpdateApi,
    ApiKeyCreateApi,
    ApiKeyDetailApi,
    ApiKeyLimitsUpdateApi,
    ApiKeyListApi,
    ApiKeyPriorityUpdateApi,
    ApiKeyRevokeApi,
    ApiKeyRotateApi,
)
from tenants.apis.audit import (
    AuditEventListApi,
)
from tenants.apis.people import (
    InvitationAcceptApi,
    InvitationCreateApi,
    InvitationListApi,
    InvitationRevokeApi,
    MeApi,
    MemberListApi,
    MemberRemoveApi,
    MemberUpdateApi,
)
from tenants.apis.tenancy import (
    TenantCacheApi,
    TenantCacheUpdateApi,
    TenantCreateApi,
    TenantDetailApi,
    TenantLimitsApi,
    TenantLimitsUpdateApi,
    TenantListApi,
    TenantUpdateApi,
)

__all__ = [
    "ApiKeyCacheUpdateApi",
    "ApiKeyCreateApi",
    "ApiKeyDetailApi",
    "ApiKeyLimitsUpdateApi",
    "ApiKeyListApi",
    "ApiKeyPriorityUpdateApi",
    "ApiKeyRevokeApi",
    "ApiKeyRotateApi",
    "AuditEventListApi",
    "InvitationAcceptApi",
    "InvitationCreateApi",
    "InvitationListApi",
    "InvitationRevokeApi",
    "MeApi",
    "MemberListApi",
    "MemberRemoveApi",
    "MemberUpdateApi",
    "TenantCacheApi",
    "TenantCacheUpdateApi",
    "TenantCreateApi",
    "TenantDetailApi",
    "TenantLimitsApi",
    "TenantLimitsUpdateApi",
    "TenantListApi",
    "TenantUpdateApi",
]
