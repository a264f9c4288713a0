from django.urls import path

from tenants import apis

app_name = "tenants"

urlpatterns = [
    path("me/", apis.MeApi.as_view(), name="me"),
    path("tenants/", apis.TenantListApi.as_view(), name="tenant-list"),
    path("tenants/create/", apis.TenantCreateApi.as_view(), name="tenant-create"),
    path("tenants/<slug:slug>/", apis.TenantDetailApi.as_view(), name="tenant-detail"),
    path("tenants/<slug:slug>/update/", apis.TenantUpdateApi.as_view(), name="tenant-update"),
    path("tenants/<slug:slug>/limits/", apis.TenantLimitsApi.as_view(), name="tenant-limits"),
    path(
        "tenants/<slug:slug>/limits/update/",
        apis.TenantLimitsUpdateApi.as_view(),
        name="tenant-limits-update",
    ),
    path("tenants/<slug:slug>/cache/", apis.TenantCacheApi.as_view(), name="tenant-cache"),
    path(
        "tenants/<slug:slug>/cache/update/",
        apis.TenantCacheUpdateApi.as_view(),
        name="tenant-cache-update",
    ),
    path("tenants/<slug:slug>/members/", apis.MemberListApi.as_view(), name="member-list"),
    path(
        "tenants/<slug:slug>/members/<int:membership_id>/update/",
        apis.MemberUpdateApi.as_view(),
        name="member-update",
    ),
    path(
        "tenants/<slug:slug>/members/<int:membership_id>/remove/",
        apis.MemberRemoveApi.as_view(),
        name="member-remove",
    ),
    path(
        "tenants/<slug:slug>/invitations/",
        apis.InvitationListApi.as_view(),
        name="invitation-list",
    ),
    path(
        "tenants/<slug:slug>/invitations/create/",
        apis.InvitationCreateApi.as_view(),
        name="invitation-create",
    ),
    path(
        "tenants/<slug:slug>/invitations/<int:invitation_id>/revoke/",
        apis.InvitationRevokeApi.as_view(),
        name="invitation-revoke",
    ),
    path("invitations/accept/", apis.InvitationAcceptApi.as_view(), name="invitation-accept"),
    path("tenants/<slug:slug>/keys/", apis.ApiKeyListApi.as_view(), name="key-list"),
    path("tenants/<slug:slug>/keys/create/", apis.ApiKeyCreateApi.as_view(), name="key-create"),
    path(
        "tenants/<slug:slug>/keys/<int:key_id>/", apis.ApiKeyDetailApi.as_view(), name="key-detail"
    ),
    path(
        "tenants/<slug:slug>/keys/<int:key_id>/revoke/",
        apis.ApiKeyRevokeApi.as_view(),
        name="key-revoke",
    ),
    path(
        "tenants/<slug:slug>/keys/<int:key_id>/rotate/",
        apis.ApiKeyRotateApi.as_view(),
        name="key-rotate",
    ),
    path(
        "tenants/<slug:slug>/keys/<int:key_id>/limits/update/",
        apis.ApiKeyLimitsUpdateApi.as_view(),
        name="key-limits-update",
    ),
    path(
        "tenants/<slug:slug>/keys/<int:key_id>/priority/update/",
        apis.ApiKeyPriorityUpdateApi.as_view(),
        name="key-priority-update",
    ),
    path(
        "tenants/<slug:slug>/keys/<int:key_id>/cache/update/",
        apis.ApiKeyCacheUpdateApi.as_view(),
        name="key-cache-update",
    ),
    path("tenants/<slug:slug>/audit/", apis.AuditEventListApi.as_view(), name="audit-list"),
]
