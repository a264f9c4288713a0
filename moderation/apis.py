"""Control API for a tenant's moderation: its policy (read, change) and its events.

``GET /api/tenants/{slug}/moderation/policy/`` (any member), ``POST …/policy/update/``
(owners and admins: send only what changes), ``GET …/moderation/events/`` (who may read the
audit log), newest first, filterable by ``where`` and ``action``.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import exceptions, serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import paginate, request_user, tenant_access
from moderation import selectors, services
from moderation.categories import CATEGORIES
from moderation.models import ModerationEvent, ModerationPolicy
from moderation.policy import (
    ACTIONS,
    MAX_REGEXES,
    MAX_TERMS,
    OUTPUT_MODES,
    PII_ACTIONS,
    PolicyInvalid,
)
from tenants.access import Perm


class CategoryRuleSerializer(serializers.Serializer[Any]):
    threshold = serializers.FloatField(min_value=0.0, max_value=1.0)
    action = serializers.ChoiceField(choices=ACTIONS)


class PolicyOutputSerializer(serializers.ModelSerializer[ModerationPolicy]):
    categories = serializers.DictField(child=CategoryRuleSerializer())

    class Meta:
        model = ModerationPolicy
        fields = [*services.FIELDS, "updated_at"]


def _policy_data(policy: ModerationPolicy | None) -> dict[str, Any]:
    if policy is None:
        return {"enabled": False, "configured": False}
    return {**PolicyOutputSerializer(policy).data, "configured": True}


class ModerationPolicyApi(APIView):
    @extend_schema(responses=PolicyOutputSerializer)
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug)
        return Response(_policy_data(selectors.moderation_policy_get(tenant=access.tenant)))


class ModerationPolicyUpdateApi(APIView):
    class InputSerializer(serializers.Serializer[Any]):
        enabled = serializers.BooleanField(required=False)
        check_input = serializers.BooleanField(required=False)
        check_output = serializers.BooleanField(required=False)
        action = serializers.ChoiceField(choices=ACTIONS, required=False)
        categories = serializers.DictField(child=CategoryRuleSerializer(), required=False)
        deny_terms = serializers.ListField(
            child=serializers.CharField(max_length=200), max_length=MAX_TERMS, required=False
        )
        regexes = serializers.ListField(
            child=serializers.CharField(max_length=500), max_length=MAX_REGEXES, required=False
        )
        pii_action = serializers.ChoiceField(choices=PII_ACTIONS, required=False)
        classifier = serializers.BooleanField(required=False)
        guard_model = serializers.CharField(max_length=100, allow_blank=True, required=False)
        output_mode = serializers.ChoiceField(choices=OUTPUT_MODES, required=False)
        window_tokens = serializers.IntegerField(min_value=4, max_value=2048, required=False)
        overlap_tokens = serializers.IntegerField(min_value=0, max_value=2047, required=False)
        fail_open = serializers.BooleanField(required=False)
        budget_ms = serializers.IntegerField(min_value=10, max_value=10_000, required=False)
        store_text = serializers.BooleanField(required=False)

        def validate_categories(self, value: dict[str, Any]) -> dict[str, Any]:
            unknown = sorted(set(value) - set(CATEGORIES))
            if unknown:
                raise serializers.ValidationError(f"unknown category: {unknown[0]}")
            return value

    @extend_schema(request=InputSerializer, responses=PolicyOutputSerializer)
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.MODERATION_MANAGE)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            policy = services.moderation_policy_set(
                tenant=access.tenant, changes=dict(data.validated_data), actor=request_user(request)
            )
        except PolicyInvalid as exc:
            raise exceptions.ValidationError({exc.field: [exc.message]}) from None
        return Response(_policy_data(policy))


class EventOutputSerializer(serializers.ModelSerializer[ModerationEvent]):
    class Meta:
        model = ModerationEvent
        fields = [
            "id",
            "request_id",
            "where",
            "action",
            "categories",
            "rules",
            "failure",
            "text",
            "key_prefix",
            "created_at",
        ]


class ModerationEventListApi(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("where", enum=[w.value for w in ModerationEvent.Where]),
            OpenApiParameter("action", enum=list(ACTIONS)),
        ],
        responses=EventOutputSerializer(many=True),
    )
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.AUDIT_VIEW)
        where, action = request.query_params.get("where"), request.query_params.get("action")
        if where and where not in ModerationEvent.Where.values:
            raise exceptions.ValidationError({"where": ["must be input or output"]})
        if action and action not in ACTIONS:
            raise exceptions.ValidationError({"action": [f"must be one of {', '.join(ACTIONS)}"]})
        events = selectors.moderation_events_list(tenant=access.tenant, where=where, action=action)
        return paginate(request, self, events, EventOutputSerializer)
