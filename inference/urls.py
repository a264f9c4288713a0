from django.urls import path

from inference import apis

app_name = "inference"

urlpatterns = [
    path(
        "tenants/<slug:slug>/cache/purge/",
        apis.TenantCachePurgeApi.as_view(),
        name="tenant-cache-purge",
    ),
    path("routes/", apis.RouteListApi.as_view(), name="route-list"),
    # A route's name may be an adapter address (<slug>/<name>): a path, not a slug.
    path("routes/<path:name>/set/", apis.RouteSetApi.as_view(), name="route-set"),
    path("routes/<path:name>/clear/", apis.RouteClearApi.as_view(), name="route-clear"),
    path("pools/", apis.PoolListApi.as_view(), name="pool-list"),
    path("pools/<slug:pool>/", apis.PoolDetailApi.as_view(), name="pool-detail"),
    path(
        "pools/<slug:pool>/replicas/create/",
        apis.ReplicaCreateApi.as_view(),
        name="replica-create",
    ),
    path(
        "pools/<slug:pool>/replicas/<int:replica_id>/drain/",
        apis.ReplicaDrainApi.as_view(),
        name="replica-drain",
    ),
    path(
        "pools/<slug:pool>/replicas/<int:replica_id>/ready/",
        apis.ReplicaReadyApi.as_view(),
        name="replica-ready",
    ),
    path(
        "pools/<slug:pool>/replicas/<int:replica_id>/remove/",
        apis.ReplicaRemoveApi.as_view(),
        name="replica-remove",
    ),
]
