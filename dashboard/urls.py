from django.contrib.auth import views as auth_views
from django.urls import path, re_path

from dashboard import views

app_name = "dashboard"

urlpatterns = [
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="dashboard/login.html"),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.home, name="home"),
    path("ops/", views.ops, name="ops"),
    path("ops/routes/", views.ops_route, name="ops-route"),
    path("ops/tenants/", views.ops_tenant_create, name="ops-tenant-create"),
    path("ops/pools/<slug:pool>/", views.ops_pool, name="ops-pool"),
    path("ops/pools/<slug:pool>/replicas/", views.ops_replica_add, name="ops-replica-add"),
    path(
        "ops/pools/<slug:pool>/replicas/<int:replica_id>/<slug:action>/",
        views.ops_replica_change,
        name="ops-replica-change",
    ),
    path("ops/prices/", views.ops_prices, name="ops-prices"),
    path("t/<slug:slug>/", views.overview, name="overview"),
    path("t/<slug:slug>/keys/", views.keys, name="keys"),
    path("t/<slug:slug>/keys/<int:key_id>/", views.key_detail, name="key"),
    path("t/<slug:slug>/keys/<int:key_id>/revoke/", views.key_revoke, name="key-revoke"),
    path("t/<slug:slug>/keys/<int:key_id>/rotate/", views.key_rotate, name="key-rotate"),
    path("t/<slug:slug>/members/", views.members, name="members"),
    path("t/<slug:slug>/members/<int:member_id>/role/", views.member_role, name="member-role"),
    path(
        "t/<slug:slug>/members/<int:member_id>/remove/", views.member_remove, name="member-remove"
    ),
    path(
        "t/<slug:slug>/invitations/<int:invitation_id>/revoke/",
        views.invitation_revoke,
        name="invitation-revoke",
    ),
    path("join/<str:token>/", views.join, name="join"),
    path("t/<slug:slug>/audit/", views.audit, name="audit"),
    path("t/<slug:slug>/limits/", views.limits, name="limits"),
    path("t/<slug:slug>/moderation/", views.moderation, name="moderation"),
    path("t/<slug:slug>/cache/", views.cache, name="cache"),
    path("t/<slug:slug>/cache/purge/", views.cache_purge, name="cache-purge"),
    path("t/<slug:slug>/playground/", views.playground, name="playground"),
    path("t/<slug:slug>/playground/key/", views.playground_key, name="playground-key"),
    path("t/<slug:slug>/usage/", views.usage, name="usage"),
    path("t/<slug:slug>/usage.csv", views.usage_csv, name="usage-csv"),
    path("t/<slug:slug>/invoices/", views.invoices, name="invoices"),
    path("t/<slug:slug>/invoices/<int:invoice_id>/", views.invoice, name="invoice"),
    re_path(
        r"^t/(?P<slug>[-\w]+)/invoices/(?P<invoice_id>\d+)/(?P<action>finalize|void)/$",
        views.invoice_change,
        name="invoice-change",
    ),
    path("t/<slug:slug>/adapters/", views.adapters, name="adapters"),
    path("t/<slug:slug>/batches/", views.batches, name="batches"),
    path("t/<slug:slug>/batches/rows/", views.batch_rows, name="batch-rows"),
    path("t/<slug:slug>/batches/<str:batch_id>/", views.batch_detail, name="batch"),
    path("t/<slug:slug>/batches/<str:batch_id>/cancel/", views.batch_cancel, name="batch-cancel"),
    path("t/<slug:slug>/files/<str:file_id>/", views.batch_file, name="batch-file"),
    path("t/<slug:slug>/adapters/rows/", views.adapter_rows, name="adapter-rows"),
    path(
        "t/<slug:slug>/adapters/<str:name>/<int:version>/delete/",
        views.adapter_delete,
        name="adapter-delete",
    ),
]
