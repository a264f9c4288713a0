"""Control API for pools, their replicas and model routes (canaries): platform staff only.

Like creating tenants, these are operator actions: anyone else gets 403 (the endpoints are
documented; no pool, replica or URL is revealed). One view per operation.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from drf_spectacular.utils import extend_schema, extend_schema_field
from redis.exceptions import RedisError
from rest_framework import serializers, status
from rest_framework.exceptions import APIException, NotFound
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import request_user, tenant_access
from fleet.models import ModelRoute, Pool, Replica
from inference import selectors, services
from tenants.access import Perm


class ReplicaOutputSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    name = serializers.CharField()
    url = serializers.CharField()
    state = serializers.CharField()
    discovered = serializers.BooleanField(help_text="Added by DNS discovery.")
    vanished_at = serializers.DateTimeField(
        allow_null=True, help_text="When its address left the pool's DNS name (it is leaving)."
    )
    in_flight = serializers.SerializerMethodField(help_text="Requests running on it now.")
    last_probe_at = serializers.DateTimeField(allow_null=True)
    last_error = serializers.CharField()
    created_at = serializers.DateTimeField()

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_in_flight(self, obj: Replica) -> int | None:
        in_flight: int | None = self.context.get("in_flight", {}).get(obj.pk)
        return in_flight


class PoolOutputSerializer(serializers.Serializer[Any]):
    name = serializers.CharField()
    kind = serializers.CharField()
    model = serializers.CharField(source="model.name")
    max_inflight = serializers.IntegerField()
    policy = serializers.CharField()
    discovery = serializers.CharField(
        source="discovery_url", help_text="'static', or http(s)://SERVICE-NAME:PORT (DNS)."
    )
    discovery_error = serializers.CharField(help_text="Why the last DNS resolution failed.")
    drain_grace_seconds = serializers.IntegerField()
    lend_percent = serializers.IntegerField(
        help_text="The percent of an online pool's capacity batch lines may borrow while no "
        "online request waits (0: none)."
    )
    replicas = serializers.SerializerMethodField()

    @extend_schema_field(ReplicaOutputSerializer(many=True))
    def get_replicas(self, obj: Pool) -> list[dict[str, object]]:
        in_flight = selectors.replicas_in_flight(pool=obj)
        replicas = obj.replicas.all()
        serializer = ReplicaOutputSerializer(replicas, many=True, context={"in_flight": in_flight})
        return list(serializer.data)


def _replica_out(replica: Replica) -> dict[str, object]:
    in_flight = selectors.replicas_in_flight(pool=replica.pool, replicas=[replica])
    data: dict[str, object] = ReplicaOutputSerializer(
        replica, context={"in_flight": in_flight}
    ).data
    return data


class PoolListApi(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(responses=PoolOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        pools = selectors.pool_list()
        return Response(PoolOutputSerializer(pools, many=True).data)


class PoolDetailApi(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(responses=PoolOutputSerializer)
    def get(self, request: Request, pool: str) -> Response:
        return Response(PoolOutputSerializer(selectors.pool_get(name=pool)).data)


class ReplicaCreateApi(APIView):
    permission_classes = [IsAdminUser]

    class InputSerializer(serializers.Serializer[Any]):
        url = serializers.CharField(max_length=200, help_text="e.g. http://10.0.0.5:8000")
        name = serializers.CharField(
            max_length=64, required=False, allow_blank=True, help_text="Default <pool>-<n>."
        )

    @extend_schema(request=InputSerializer, responses={201: ReplicaOutputSerializer})
    def post(self, request: Request, pool: str) -> Response:
        the_pool = selectors.pool_get(name=pool)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        replica = services.replica_add(
            pool=the_pool,
            url=data.validated_data["url"],
            name=data.validated_data.get("name", ""),
            actor=request_user(request),
        )
        return Response(_replica_out(replica), status=status.HTTP_201_CREATED)


class ReplicaDrainApi(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(request=None, responses=ReplicaOutputSerializer)
    def post(self, request: Request, pool: str, replica_id: int) -> Response:
        replica = selectors.replica_get(pool=selectors.pool_get(name=pool), replica_id=replica_id)
        return Response(
            _replica_out(services.replica_drain(replica=replica, actor=request_user(request)))
        )


class ReplicaReadyApi(APIView):
    """Undrain: probed at once, then ``ready`` if it answers (``down`` otherwise)."""

    permission_classes = [IsAdminUser]

    @extend_schema(request=None, responses=ReplicaOutputSerializer)
    def post(self, request: Request, pool: str, replica_id: int) -> Response:
        replica = selectors.replica_get(pool=selectors.pool_get(name=pool), replica_id=replica_id)
        return Response(
            _replica_out(services.replica_undrain(replica=replica, actor=request_user(request)))
        )


class ReplicaRemoveApi(APIView):
    """Refused (400) while requests run on it, unless ``force``: drain first, then remove."""

    permission_classes = [IsAdminUser]

    class InputSerializer(serializers.Serializer[Any]):
        force = serializers.BooleanField(default=False)

    class OutputSerializer(serializers.Serializer[Any]):
        removed = serializers.CharField(help_text="The replica's name.")
        in_flight = serializers.IntegerField(help_text="Requests that were running on it.")

    @extend_schema(request=InputSerializer, responses=OutputSerializer)
    def post(self, request: Request, pool: str, replica_id: int) -> Response:
        replica = selectors.replica_get(pool=selectors.pool_get(name=pool), replica_id=replica_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        name = replica.name
        in_flight = services.replica_remove(
            replica=replica, force=data.validated_data["force"], actor=request_user(request)
        )
        return Response(self.OutputSerializer({"removed": name, "in_flight": in_flight}).data)


# --- routes (canaries) -------------------------------------------------------------------


class RouteTargetSerializer(serializers.Serializer[Any]):
    target = serializers.CharField(
        max_length=200, help_text="A model's name, or <slug>/<adapter>:<version>."
    )
    weight = serializers.IntegerField(min_value=0, max_value=services.MAX_ROUTE_WEIGHT)


class RouteOutputSerializer(serializers.Serializer[Any]):
    name = serializers.CharField()
    targets = RouteTargetSerializer(many=True)
    updated_at = serializers.DateTimeField()


def _route_out(route: ModelRoute) -> dict[str, object]:
    return {
        "name": route.name,
        "targets": [{"target": t, "weight": w} for t, w in route.targets],
        "updated_at": route.updated_at,
    }


class RouteListApi(APIView):
    """Every routed model name and its weighted targets."""

    permission_classes = [IsAdminUser]

    @extend_schema(responses={200: RouteOutputSerializer(many=True)})
    def get(self, request: Request) -> Response:
        return Response([_route_out(route) for route in selectors.model_route_list()])


class RouteSetApi(APIView):
    """Route a name to weighted targets (a canary), or move the weights (a rollback: 100 to
    the stable target). Every web process follows within a second."""

    permission_classes = [IsAdminUser]

    class InputSerializer(serializers.Serializer[Any]):
        targets = RouteTargetSerializer(many=True, allow_empty=False)

    @extend_schema(request=InputSerializer, responses={200: RouteOutputSerializer})
    def put(self, request: Request, name: str) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        targets = [(t["target"], t["weight"]) for t in data.validated_data["targets"]]
        with transaction.atomic():
            route = services.model_route_set(
                name=name, targets=targets, actor=request_user(request)
            )
        return Response(_route_out(route))


class RouteClearApi(APIView):
    """Stop routing a name."""

    permission_classes = [IsAdminUser]

    @extend_schema(request=None, responses={204: None})
    def delete(self, request: Request, name: str) -> Response:
        with transaction.atomic():
            if not services.model_route_clear(name=name, actor=request_user(request)):
                raise NotFound(f"No route named {name!r}.")
        return Response(status=status.HTTP_204_NO_CONTENT)


class TenantCachePurgeApi(APIView):
    """Every answer in a tenant's response cache gone (docs/cache.md): for the tenant's
    owners and admins, not only the platform's staff."""

    class OutputSerializer(serializers.Serializer[Any]):
        purged = serializers.IntegerField(help_text="Answers the cache held.")

    @extend_schema(request=None, responses=OutputSerializer)
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.CACHE_MANAGE)
        try:
            purged = services.response_cache_purge(
                tenant=access.tenant, actor=request_user(request)
            )
        except RedisError:
            raise Unavailable() from None
        return Response({"purged": purged})


class Unavailable(APIException):
    status_code = 503
    default_detail = "The cache cannot be reached right now; nothing was purged. Retry shortly."
    default_code = "unavailable"
