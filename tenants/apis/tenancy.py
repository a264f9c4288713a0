"""Control API for tenants: list, create (staff), read, update, limits, response cache."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import paginate, request_user, tenant_access
from tenants import selectors, services
from tenants.access import Perm
from tenants.apis.limits import TenantLimitsInputSerializer, TenantLimitsOutputSerializer
from tenants.models import (
    Tenant,
)
from tenants.priority import DEFAULT_CLASS, PriorityClass

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
