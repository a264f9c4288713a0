from django.urls import path

from inference import apis

app_name = "inference"

urlpatterns = [
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
