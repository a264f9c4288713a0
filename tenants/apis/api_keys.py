"""Control API for API keys: list, issue (the secret once), revoke, rotate, limits, class, cache."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import paginate, request_user, tenant_access
from tenants import selectors, services
from tenants.access import Perm
from tenants.apis.limits import LimitsInputSerializer, LimitsOutputSerializer, effective
from tenants.models import (
    ApiKey,
)
from tenants.priority import PriorityClass

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
        return effective(obj)

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
