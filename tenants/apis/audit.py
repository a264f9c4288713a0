"""Control API for a tenant's audit log."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import paginate, tenant_access
from tenants import selectors
from tenants.access import Perm

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
