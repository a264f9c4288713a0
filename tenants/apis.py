"""Control API for tenants, members, API keys, limits and the audit log.

One view per operation (HackSoft style): parse, check access, call one service, serialize.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.urls import reverse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import paginate, request_user, tenant_access
from tenants import selectors, services
from tenants.access import Perm
from tenants.models import (
    MAX_BUDGET,
    MAX_RATE,
    ApiKey,
    Invitation,
    LimitFields,
    Role,
    Tenant,
    User,
    tighter,
)
from tenants.priority import DEFAULT_CLASS, PriorityClass

MICROS = Decimal(1_000_000)


# --- Limits (shared by tenants and keys) -----------------------------------------------------


def _limit_field() -> serializers.IntegerField:
    return serializers.IntegerField(
        min_value=1, max_value=MAX_RATE, allow_null=True, required=False
    )


class LimitsInputSerializer(serializers.Serializer[Any]):
    """Send only what changes; ``null`` means unlimited."""

    rpm = _limit_field()
    tpm = _limit_field()
    max_concurrency = _limit_field()
    max_tokens_per_request = _limit_field()
    monthly_token_budget = serializers.IntegerField(
        min_value=1, max_value=MAX_BUDGET, allow_null=True, required=False
    )
    monthly_spend_budget_usd = serializers.DecimalField(
        max_digits=18,
        decimal_places=6,
        min_value=Decimal("0.000001"),
        max_value=Decimal(MAX_BUDGET) / MICROS,
        allow_null=True,
        required=False,
    )

    def to_limits(self) -> dict[str, int | None]:
        """The limits that were sent, in the model's units."""
        data = self.validated_data
        limits = {k: data[k] for k in LimitFields.LIMIT_NAMES if k in data}
        if "monthly_spend_budget_usd" in data:
            usd = data["monthly_spend_budget_usd"]
            limits["monthly_spend_budget_micros"] = None if usd is None else int(usd * MICROS)
        return limits


class LimitsOutputSerializer(serializers.Serializer[Any]):
    rpm = serializers.IntegerField(allow_null=True)
    tpm = serializers.IntegerField(allow_null=True)
    max_concurrency = serializers.IntegerField(allow_null=True)
    max_tokens_per_request = serializers.IntegerField(allow_null=True)
    monthly_token_budget = serializers.IntegerField(allow_null=True)
    monthly_spend_budget_usd = serializers.SerializerMethodField()

    def get_monthly_spend_budget_usd(self, obj: LimitFields) -> str | None:
        micros = obj.monthly_spend_budget_micros
        return None if micros is None else str(Decimal(micros) / MICROS)


class TenantLimitsInputSerializer(LimitsInputSerializer):
    """A tenant's limits, and its quotas on files and batches (``null``: the default)."""

    storage_mb = _limit_field()
    max_open_batches = _limit_field()
    batch_queue_tokens = serializers.IntegerField(
        min_value=1, max_value=MAX_BUDGET, allow_null=True, required=False
    )

    def to_limits(self) -> dict[str, int | None]:
        data = self.validated_data
        return super().to_limits() | {k: data[k] for k in Tenant.QUOTA_NAMES if k in data}


class TenantLimitsOutputSerializer(LimitsOutputSerializer):
    """The quotas as they apply; ``quotas_by_default`` names those the tenant takes from the
    platform's defaults."""

    storage_mb = serializers.SerializerMethodField()
    max_open_batches = serializers.SerializerMethodField()
    batch_queue_tokens = serializers.SerializerMethodField()
    quotas_by_default = serializers.SerializerMethodField()

    def get_storage_mb(self, obj: Tenant) -> int:
        return obj.quota("storage_mb")

    def get_max_open_batches(self, obj: Tenant) -> int:
        return obj.quota("max_open_batches")

    def get_batch_queue_tokens(self, obj: Tenant) -> int:
        return obj.quota("batch_queue_tokens")

    def get_quotas_by_default(self, obj: Tenant) -> list[str]:
        return [name for name in Tenant.QUOTA_NAMES if getattr(obj, name) is None]


def _effective(key: ApiKey) -> dict[str, Any]:
    """The limits a key actually gets: the tighter of its own and its tenant's."""
    result: dict[str, Any] = {}
    for name in LimitFields.LIMIT_NAMES:
        result[name] = tighter(getattr(key, name), getattr(key.tenant, name))
    micros = result.pop("monthly_spend_budget_micros")
    result["monthly_spend_budget_usd"] = None if micros is None else str(Decimal(micros) / MICROS)
    return result


# --- Tenants ---------------------------------------------------------------------------------


class TenantOutputSerializer(serializers.ModelSerializer[Tenant]):
    limits = TenantLimitsOutputSerializer(source="*")

    class Meta:
        model = Tenant
        fields = ["slug", "name", "status", "weight", "priority_class", "limits", "created_at"]


class TenantListApi(APIView):
    @extend_schema(responses=TenantOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        tenants = selectors.tenant_list_for_user(user=request_user(request))
        return paginate(request, self, tenants, TenantOutputSerializer)


class TenantCreateApi(APIView):
    permission_classes = [IsAdminUser]

    class InputSerializer(TenantLimitsInputSerializer):
        slug = serializers.CharField(max_length=40)
        name = serializers.CharField(max_length=200, required=False, allow_blank=True)
        weight = serializers.IntegerField(min_value=1, max_value=1000, default=1)
        priority_class = serializers.ChoiceField(
            choices=PriorityClass.choices, default=DEFAULT_CLASS
        )

    @extend_schema(request=InputSerializer, responses={201: TenantOutputSerializer})
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        tenant = services.tenant_create(
            slug=data.validated_data["slug"],
            name=data.validated_data.get("name", ""),
            weight=data.validated_data["weight"],
            priority_class=data.validated_data["priority_class"],
            limits=data.to_limits(),
            actor=request_user(request),
        )
        return Response(TenantOutputSerializer(tenant).data, status=status.HTTP_201_CREATED)


class TenantDetailApi(APIView):
    class OutputSerializer(TenantOutputSerializer):
        role = serializers.SerializerMethodField()

        class Meta(TenantOutputSerializer.Meta):
            fields = [*TenantOutputSerializer.Meta.fields, "role"]

        def get_role(self, obj: Tenant) -> str | None:
            return self.context.get("role")

    @extend_schema(responses=OutputSerializer)
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug)
        return Response(self.OutputSerializer(access.tenant, context={"role": access.role}).data)


class TenantUpdateApi(APIView):
    class InputSerializer(serializers.Serializer[Any]):
        name = serializers.CharField(max_length=200, required=False)
        status = serializers.ChoiceField(choices=Tenant.Status.choices, required=False)
        weight = serializers.IntegerField(min_value=1, max_value=1000, required=False)
        priority_class = serializers.ChoiceField(choices=PriorityClass.choices, required=False)

    @extend_schema(request=InputSerializer, responses=TenantOutputSerializer)
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.PLATFORM)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        tenant = services.tenant_update(
            tenant=access.tenant, actor=request_user(request), **data.validated_data
        )
        return Response(TenantOutputSerializer(tenant).data)


class TenantLimitsApi(APIView):
    @extend_schema(responses=TenantLimitsOutputSerializer)
    def get(self, request: Request, slug: str) -> Response:
        tenant = tenant_access(request, slug).tenant
        return Response(TenantLimitsOutputSerializer(tenant).data)


class TenantLimitsUpdateApi(APIView):
    @extend_schema(request=TenantLimitsInputSerializer, responses=TenantLimitsOutputSerializer)
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.PLATFORM)
        data = TenantLimitsInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        tenant = services.tenant_limits_update(
            tenant=access.tenant, actor=request_user(request), limits=data.to_limits()
        )
        return Response(TenantLimitsOutputSerializer(tenant).data)


class TenantCacheOutputSerializer(serializers.Serializer[Any]):
    mode = serializers.CharField(
        source="response_cache", help_text="off, or exact: a repeated request gets the answer"
    )
    ttl_seconds = serializers.IntegerField(source="response_cache_ttl_seconds")
    threshold = serializers.FloatField(
        source="response_cache_threshold", help_text="semantic: the similarity a hit needs"
    )
    embedding_model = serializers.CharField(
        source="response_cache_embedding_model", help_text="semantic: the model that embeds"
    )


class TenantCacheApi(APIView):
    """The tenant's response cache (docs/cache.md): whether it is on, and for how long an
    answer is served."""

    @extend_schema(responses=TenantCacheOutputSerializer)
    def get(self, request: Request, slug: str) -> Response:
        tenant = tenant_access(request, slug).tenant
        return Response(TenantCacheOutputSerializer(tenant).data)


class TenantCacheUpdateApi(APIView):
    class InputSerializer(serializers.Serializer[Any]):
        mode = serializers.ChoiceField(choices=Tenant.Cache.choices, required=False)
        ttl_seconds = serializers.IntegerField(min_value=60, max_value=30 * 86400, required=False)
        threshold = serializers.FloatField(min_value=0.5, max_value=1.0, required=False)
        embedding_model = serializers.CharField(max_length=200, required=False)

    @extend_schema(request=InputSerializer, responses=TenantCacheOutputSerializer)
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.CACHE_MANAGE)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        given = data.validated_data
        try:
            tenant = services.tenant_cache_update(
                tenant=access.tenant,
                actor=request_user(request),
                mode=given.get("mode"),
                ttl_seconds=given.get("ttl_seconds"),
                threshold=given.get("threshold"),
                embedding_model=given.get("embedding_model"),
            )
        except DjangoValidationError as exc:
            raise exceptions.ValidationError(exc.message_dict) from None
        return Response(TenantCacheOutputSerializer(tenant).data)


# --- Members -------------------------------------------------------------------------------


class MembershipOutputSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    username = serializers.CharField(source="user.username")
    email = serializers.EmailField(source="user.email")
    role = serializers.CharField()
    created_at = serializers.DateTimeField()


class MemberListApi(APIView):
    @extend_schema(responses=MembershipOutputSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug)
        members = selectors.membership_list(tenant=access.tenant)
        return paginate(request, self, members, MembershipOutputSerializer)


class MemberUpdateApi(APIView):
    class InputSerializer(serializers.Serializer[Any]):
        role = serializers.ChoiceField(choices=Role.choices)

    @extend_schema(request=InputSerializer, responses=MembershipOutputSerializer)
    def post(self, request: Request, slug: str, membership_id: int) -> Response:
        access = tenant_access(request, slug, Perm.MEMBERS_MANAGE)
        membership = selectors.membership_get(tenant=access.tenant, membership_id=membership_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = services.membership_change_role(
            membership=membership,
            role=data.validated_data["role"],
            actor=request_user(request),
            actor_role=None if access.is_staff else access.role,
        )
        return Response(MembershipOutputSerializer(membership).data)


class MemberRemoveApi(APIView):
    @extend_schema(request=None, responses={204: None})
    def post(self, request: Request, slug: str, membership_id: int) -> Response:
        access = tenant_access(request, slug)
        membership = selectors.membership_get(tenant=access.tenant, membership_id=membership_id)
        user = request_user(request)
        leaving = membership.user_id == user.pk  # anyone may leave (but not the last owner)
        if not leaving and not access.can(Perm.MEMBERS_MANAGE):
            raise exceptions.PermissionDenied(f"Your role in {slug} does not allow this.")
        services.membership_remove(
            membership=membership,
            actor=user,
            actor_role=None if access.is_staff or leaving else access.role,
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- Invitations -----------------------------------------------------------------------------
# People join a tenant only by accepting an invitation: an owner or admin creates a one-time
# link and passes it on; nothing here says whether an account exists for anyone.


class InvitationOutputSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    role = serializers.CharField()
    status = serializers.SerializerMethodField()
    created_by = serializers.CharField(source="created_by.username", default=None)
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()

    def get_status(self, obj: Invitation) -> str:
        """``pending``, ``accepted``, ``revoked`` or ``expired``."""
        if obj.accepted_at is not None:
            return "accepted"
        if obj.revoked_at is not None:
            return "revoked"
        return "pending" if obj.is_open else "expired"


class InvitationListApi(APIView):
    """The tenant's pending invitations (not yet used, revoked or expired)."""

    @extend_schema(responses=InvitationOutputSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.MEMBERS_MANAGE)
        invitations = selectors.invitation_list_open(tenant=access.tenant)
        return paginate(request, self, invitations, InvitationOutputSerializer)


class InvitationCreateApi(APIView):
    """A one-time invitation link (valid 7 days). Its token is in this response only; only
    owners invite owners."""

    class InputSerializer(serializers.Serializer[Any]):
        role = serializers.ChoiceField(choices=Role.choices)

    class OutputSerializer(InvitationOutputSerializer):
        token = serializers.CharField(help_text="Shown only in this response.")
        url = serializers.CharField(
            help_text="The link to pass on (the dashboard's sign-up or one-click join page)."
        )

    @extend_schema(request=InputSerializer, responses={201: OutputSerializer})
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.MEMBERS_MANAGE)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        issued = services.invitation_create(
            tenant=access.tenant,
            role=data.validated_data["role"],
            actor=request_user(request),
            actor_role=None if access.is_staff else access.role,
        )
        body = {
            **InvitationOutputSerializer(issued.invitation).data,
            "token": issued.token,
            "url": request.build_absolute_uri(reverse("dashboard:join", args=[issued.token])),
        }
        response = Response(body, status=status.HTTP_201_CREATED)
        response["Cache-Control"] = "no-store"  # the token is in this response, once
        return response


class InvitationRevokeApi(APIView):
    @extend_schema(request=None, responses=InvitationOutputSerializer)
    def post(self, request: Request, slug: str, invitation_id: int) -> Response:
        access = tenant_access(request, slug, Perm.MEMBERS_MANAGE)
        invitation = selectors.invitation_get(tenant=access.tenant, invitation_id=invitation_id)
        invitation = services.invitation_revoke(invitation=invitation, actor=request_user(request))
        return Response(InvitationOutputSerializer(invitation).data)


class InvitationAcceptApi(APIView):
    """Join the tenant an invitation names, as the calling user (the link works once)."""

    class InputSerializer(serializers.Serializer[Any]):
        token = serializers.CharField(max_length=200)

    @extend_schema(request=InputSerializer, responses={201: MembershipOutputSerializer})
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            membership = services.invitation_accept(
                token=data.validated_data["token"], user=request_user(request)
            )
        except DjangoValidationError as exc:
            raise exceptions.ValidationError({"token": exc.messages}) from None
        return Response(MembershipOutputSerializer(membership).data, status=status.HTTP_201_CREATED)


# --- API keys --------------------------------------------------------------------------------


class ApiKeyOutputSerializer(serializers.ModelSerializer[ApiKey]):
    created_by = serializers.CharField(source="created_by.username", default=None)
    limits = LimitsOutputSerializer(source="*", help_text="This key's own overrides.")
    effective_limits = serializers.SerializerMethodField()
    effective_priority_class = serializers.SerializerMethodField(
        help_text="The class its requests run in (the key's, else its tenant's)."
    )

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "display_prefix",
            "scopes",
            "status",
            "created_by",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "limits",
            "effective_limits",
            "use_response_cache",
            "priority_class",
            "effective_priority_class",
        ]

    def get_effective_limits(self, obj: ApiKey) -> dict[str, Any]:
        return _effective(obj)

    def get_effective_priority_class(self, obj: ApiKey) -> str:
        return obj.effective_priority_class


class ApiKeyIssuedSerializer(ApiKeyOutputSerializer):
    key = serializers.CharField(help_text="The secret key. Shown once, never again.")

    class Meta(ApiKeyOutputSerializer.Meta):
        fields = [*ApiKeyOutputSerializer.Meta.fields, "key"]


def _issued(issued: services.IssuedKey) -> dict[str, Any]:
    data = dict(ApiKeyOutputSerializer(issued.api_key).data)
    data["key"] = issued.secret
    return data


class ApiKeyListApi(APIView):
    @extend_schema(responses=ApiKeyOutputSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug)
        return paginate(
            request, self, selectors.api_key_list(tenant=access.tenant), ApiKeyOutputSerializer
        )


class ApiKeyDetailApi(APIView):
    @extend_schema(responses=ApiKeyOutputSerializer)
    def get(self, request: Request, slug: str, key_id: int) -> Response:
        access = tenant_access(request, slug)
        key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
        return Response(ApiKeyOutputSerializer(key).data)


class ApiKeyCreateApi(APIView):
    class InputSerializer(LimitsInputSerializer):
        name = serializers.CharField(max_length=100)
        scopes = serializers.ListField(
            child=serializers.ChoiceField(choices=ApiKey.Scope.choices),
            required=False,
            allow_empty=False,
        )
        expires_at = serializers.DateTimeField(required=False, allow_null=True)
        priority_class = serializers.ChoiceField(
            choices=[("", "the tenant's"), *PriorityClass.choices], required=False
        )

    @extend_schema(request=InputSerializer, responses={201: ApiKeyIssuedSerializer})
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.KEYS_CREATE)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        limits = data.to_limits()
        priority_class = data.validated_data.get("priority_class", "")
        if (limits or priority_class) and not access.can(Perm.KEY_LIMITS_EDIT):
            raise exceptions.PermissionDenied(
                "Your role does not allow setting key limits or a key's priority class."
            )
        issued = services.api_key_create(
            tenant=access.tenant,
            name=data.validated_data["name"],
            created_by=request_user(request),
            scopes=data.validated_data.get("scopes"),
            expires_at=data.validated_data.get("expires_at"),
            limits=limits,
            priority_class=priority_class,
        )
        return Response(_issued(issued), status=status.HTTP_201_CREATED)


def _key_for_change(request: Request, slug: str, key_id: int) -> ApiKey:
    """Owners and admins change any key; developers only the keys they created."""
    access = tenant_access(request, slug, Perm.KEYS_CREATE)
    key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
    if not access.can(Perm.KEYS_MANAGE_ANY) and key.created_by_id != request_user(request).pk:
        raise exceptions.PermissionDenied("You can only change keys you created.")
    return key


class ApiKeyRevokeApi(APIView):
    @extend_schema(request=None, responses=ApiKeyOutputSerializer)
    def post(self, request: Request, slug: str, key_id: int) -> Response:
        key = _key_for_change(request, slug, key_id)
        key = services.api_key_revoke(api_key=key, actor=request_user(request))
        return Response(ApiKeyOutputSerializer(key).data)


class ApiKeyRotateApi(APIView):
    class InputSerializer(serializers.Serializer[Any]):
        grace_period_seconds = serializers.IntegerField(
            min_value=0,
            max_value=30 * 24 * 3600,
            required=False,
            help_text="How long the old key keeps working (default 24 hours).",
        )

    @extend_schema(request=InputSerializer, responses={201: ApiKeyIssuedSerializer})
    def post(self, request: Request, slug: str, key_id: int) -> Response:
        key = _key_for_change(request, slug, key_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        issued = services.api_key_rotate(
            api_key=key,
            actor=request_user(request),
            grace_seconds=data.validated_data.get("grace_period_seconds"),
        )
        return Response(_issued(issued), status=status.HTTP_201_CREATED)


class ApiKeyLimitsUpdateApi(APIView):
    @extend_schema(request=LimitsInputSerializer, responses=ApiKeyOutputSerializer)
    def post(self, request: Request, slug: str, key_id: int) -> Response:
        access = tenant_access(request, slug, Perm.KEY_LIMITS_EDIT)
        key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
        data = LimitsInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        key = services.api_key_limits_update(
            api_key=key, actor=request_user(request), limits=data.to_limits()
        )
        return Response(ApiKeyOutputSerializer(key).data)


class ApiKeyPriorityUpdateApi(APIView):
    """The priority class the key's requests run in: blank for its tenant's, or a lower one
    (docs/priority.md)."""

    class InputSerializer(serializers.Serializer[Any]):
        priority_class = serializers.ChoiceField(
            choices=[("", "the tenant's"), *PriorityClass.choices], allow_blank=True
        )

    @extend_schema(request=InputSerializer, responses=ApiKeyOutputSerializer)
    def post(self, request: Request, slug: str, key_id: int) -> Response:
        access = tenant_access(request, slug, Perm.KEY_LIMITS_EDIT)
        key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        key = services.api_key_priority_update(
            api_key=key,
            actor=request_user(request),
            priority_class=data.validated_data["priority_class"],
        )
        return Response(ApiKeyOutputSerializer(key).data)


class ApiKeyCacheUpdateApi(APIView):
    """Whether the key's requests use the tenant's response cache (docs/cache.md)."""

    class InputSerializer(serializers.Serializer[Any]):
        use_response_cache = serializers.BooleanField()

    @extend_schema(request=InputSerializer, responses=ApiKeyOutputSerializer)
    def post(self, request: Request, slug: str, key_id: int) -> Response:
        access = tenant_access(request, slug, Perm.CACHE_MANAGE)
        key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        key = services.api_key_cache_update(
            api_key=key,
            actor=request_user(request),
            enabled=data.validated_data["use_response_cache"],
        )
        return Response(ApiKeyOutputSerializer(key).data)


# --- Audit -----------------------------------------------------------------------------------


class AuditEventOutputSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    actor = serializers.CharField(source="actor_label")
    action = serializers.CharField()
    target_type = serializers.CharField()
    target_id = serializers.CharField()
    target = serializers.CharField(source="target_label")
    details = serializers.JSONField()


class AuditEventListApi(APIView):
    class FilterSerializer(serializers.Serializer[Any]):
        action = serializers.CharField(required=False, max_length=64)
        since = serializers.DateTimeField(required=False)

    @extend_schema(
        parameters=[
            OpenApiParameter("action", str, description="Action prefix, e.g. api_key."),
            OpenApiParameter("since", str, description="ISO 8601 time."),
        ],
        responses=AuditEventOutputSerializer(many=True),
    )
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.AUDIT_VIEW)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        events = selectors.audit_event_list(tenant=access.tenant, **filters.validated_data)
        return paginate(request, self, events, AuditEventOutputSerializer)


# --- Me ----------------------------------------------------------------------------------------


class MeApi(APIView):
    class OutputSerializer(serializers.Serializer[Any]):
        username = serializers.CharField()
        email = serializers.EmailField()
        is_staff = serializers.BooleanField()
        memberships = serializers.SerializerMethodField()

        def get_memberships(self, user: User) -> list[dict[str, str]]:
            return [
                {"tenant": m.tenant.slug, "role": m.role}
                for m in user.memberships.select_related("tenant")
            ]

    @extend_schema(responses=OutputSerializer)
    def get(self, request: Request) -> Response:
        return Response(self.OutputSerializer(request_user(request)).data)
