"""The control API for a tenant's LoRA adapters: list, upload, retrieve, delete."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.parsers import MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from adapters import selectors, services
from adapters.models import Adapter
from controlplane.api import paginate, request_user, tenant_access
from tenants.access import Perm, TenantAccess


class PayloadTooLarge(exceptions.APIException):
    status_code = 413
    default_detail = "The upload is too large."
    default_code = "payload_too_large"


class AdapterOutputSerializer(serializers.Serializer[Any]):
    name = serializers.CharField()
    version = serializers.IntegerField()
    model = serializers.SerializerMethodField(help_text="What to send as `model` on /v1.")
    status = serializers.CharField()
    reason = serializers.CharField()
    sha256 = serializers.CharField()
    size_bytes = serializers.IntegerField()
    base_model = serializers.CharField(source="base_model.name", default=None)
    rank = serializers.IntegerField()
    target_modules = serializers.ListField(child=serializers.CharField())
    created_at = serializers.DateTimeField()
    validated_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField()

    def get_model(self, adapter: Adapter) -> str:
        return f"{adapter.tenant.slug}/{adapter.name}:{adapter.version}"


class AdapterListApi(APIView):
    @extend_schema(responses=AdapterOutputSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.VIEW)
        adapters = selectors.adapter_list(tenant=access.tenant).select_related(
            "tenant", "base_model"
        )
        return paginate(request, self, adapters, AdapterOutputSerializer)


class AdapterUploadApi(APIView):
    """Multipart: ``name`` and either ``archive`` (.zip / .tar.gz) or ``adapter_config`` +
    ``adapter_model``. Answers 202: validation runs in the background (poll the adapter)."""

    parser_classes = [MultiPartParser]

    class InputSerializer(serializers.Serializer[Any]):
        name = serializers.CharField(max_length=63)
        archive = serializers.FileField(required=False)
        adapter_config = serializers.FileField(required=False)
        adapter_model = serializers.FileField(required=False)

    @extend_schema(request=InputSerializer, responses={202: AdapterOutputSerializer})
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.ADAPTERS_MANAGE)
        try:
            declared = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            declared = 0
        if declared > settings.ADAPTER_MAX_BYTES:
            raise PayloadTooLarge(
                f"Adapters are limited to {settings.ADAPTER_MAX_BYTES:,} bytes per upload."
            )
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        files = {
            part: data.validated_data[part]
            for part in ("archive", "adapter_config", "adapter_model")
            if part in data.validated_data
        }
        try:
            adapter = services.adapter_upload(
                tenant=access.tenant,
                name=data.validated_data["name"],
                files=files,
                actor=request_user(request),
            )
        except DjangoValidationError as exc:
            raise exceptions.ValidationError(
                exc.message_dict if hasattr(exc, "error_dict") else {"name": exc.messages}
            ) from None
        return Response(AdapterOutputSerializer(adapter).data, status=status.HTTP_202_ACCEPTED)


def _adapter(access: TenantAccess, name: str, version: int) -> Adapter:
    try:
        return selectors.adapter_get(tenant=access.tenant, name=name, version=version)
    except Adapter.DoesNotExist:
        raise exceptions.NotFound() from None


class AdapterDetailApi(APIView):
    @extend_schema(responses=AdapterOutputSerializer)
    def get(self, request: Request, slug: str, name: str, version: int) -> Response:
        access = tenant_access(request, slug, Perm.VIEW)
        return Response(AdapterOutputSerializer(_adapter(access, name, version)).data)


class AdapterDeleteApi(APIView):
    @extend_schema(request=None, responses={204: None})
    def post(self, request: Request, slug: str, name: str, version: int) -> Response:
        access = tenant_access(request, slug, Perm.ADAPTERS_MANAGE)
        services.adapter_delete(
            adapter=_adapter(access, name, version), actor=request_user(request)
        )
        return Response(status=status.HTTP_204_NO_CONTENT)
