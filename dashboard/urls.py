from django.contrib.auth import views as auth_views
from django.urls import path, re_path

from dashboard.views import (
    api_keys,
    batch_jobs,
    lora,
    overview,
    people,
    platform_ops,
    playground,
    policies,
    spend,
)

app_name = "dashboard"

urlpatterns = [
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="dashboard/login.html"),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", overview.home, name="home"),
    path("ops/", platform_ops.ops, name="ops"),
    path("ops/routes/", platform_ops.ops_route, name="ops-route"),
    path("ops/tenants/", platform_ops.ops_tenant_create, name="ops-tenant-create"),
    path("ops/pools/<slug:pool>/", platform_ops.ops_pool, name="ops-pool"),
    path("ops/pools/<slug:pool>/replicas/", platform_ops.ops_replica_add, name="ops-replica-add"),
    path(
        "ops/pools/<slug:pool>/replicas/<int:replica_id>/<slug:action>/",
        platform_ops.ops_replica_change,
        name="ops-replica-change",
    ),
    path("ops/prices/", platform_ops.ops_prices, name="ops-prices"),
    path("t/<slug:slug>/", overview.overview, name="overview"),
    path("t/<slug:slug>/keys/", api_keys.keys, name="keys"),
    path("t/<slug:slug>/keys/<int:key_id>/", api_keys.key_detail, name="key"),
    path("t/<slug:slug>/keys/<int:key_id>/revoke/", api_keys.key_revoke, name="key-revoke"),
    path("t/<slug:slug>/keys/<int:key_id>/rotate/", api_keys.key_rotate, name="key-rotate"),
    path("t/<slug:slug>/members/", people.members, name="members"),
    path("t/<slug:slug>/members/<int:member_id>/role/", people.member_role, name="member-role"),
    path(
        "t/<slug:slug>/members/<int:member_id>/remove/", people.member_remove, name="member-remove"
    ),
    path(
        "t/<slug:slug>/invitations/<int:invitation_id>/revoke/",
        people.invitation_revoke,
        name="invitation-revoke",
    ),
    path("join/<str:token>/", people.join, name="join"),
    path("t/<slug:slug>/audit/", people.audit, name="audit"),
    path("t/<slug:slug>/limits/", policies.limits, name="limits"),
    path("t/<slug:slug>/moderation/", policies.moderation, name="moderation"),
    path("t/<slug:slug>/cache/", policies.cache, name="cache"),
    path("t/<slug:slug>/cache/purge/", policies.cache_purge, name="cache-purge"),
    path("t/<slug:slug>/playground/", playground.playground, name="playground"),
    path("t/<slug:slug>/playground/key/", playground.playground_key, name="playground-key"),
    path("t/<slug:slug>/usage/", spend.usage, name="usage"),
    path("t/<slug:slug>/usage.csv", spend.usage_csv, name="usage-csv"),
    path("t/<slug:slug>/invoices/", spend.invoices, name="invoices"),
    path("t/<slug:slug>/invoices/<int:invoice_id>/", spend.invoice, name="invoice"),
    re_path(
        r"^t/(?P<slug>[-\w]+)/invoices/(?P<invoice_id>\d+)/(?P<action>finalize|void)/$",
        spend.invoice_change,
        name="invoice-change",
    ),
    path("t/<slug:slug>/adapters/", lora.adapters, name="adapters"),
    path("t/<slug:slug>/batches/", batch_jobs.batches, name="batches"),
    path("t/<slug:slug>/batches/rows/", batch_jobs.batch_rows, name="batch-rows"),
    path("t/<slug:slug>/batches/<str:batch_id>/", batch_jobs.batch_detail, name="batch"),
    path(
        "t/<slug:slug>/batches/<str:batch_id>/cancel/", batch_jobs.batch_cancel, name="batch-cancel"
    ),
    path("t/<slug:slug>/files/<str:file_id>/", batch_jobs.batch_file, name="batch-file"),
    path("t/<slug:slug>/adapters/rows/", lora.adapter_rows, name="adapter-rows"),
    path(
        "t/<slug:slug>/adapters/<str:name>/<int:version>/delete/",
        lora.adapter_delete,
        name="adapter-delete",
    ),
]
