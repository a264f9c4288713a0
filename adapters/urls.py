from django.urls import path

from adapters import apis

app_name = "adapters"

urlpatterns = [
    path("tenants/<slug:slug>/adapters/", apis.AdapterListApi.as_view(), name="adapter-list"),
    path(
        "tenants/<slug:slug>/adapters/upload/",
        apis.AdapterUploadApi.as_view(),
        name="adapter-upload",
    ),
    path(
        "tenants/<slug:slug>/adapters/<str:name>/<int:version>/",
        apis.AdapterDetailApi.as_view(),
        name="adapter-detail",
    ),
    path(
        "tenants/<slug:slug>/adapters/<str:name>/<int:version>/delete/",
        apis.AdapterDeleteApi.as_view(),
        name="adapter-delete",
    ),
]
