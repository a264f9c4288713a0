from django.urls import path

from moderation import apis

app_name = "moderation"

urlpatterns = [
    path(
        "tenants/<slug:slug>/moderation/policy/",
        apis.ModerationPolicyApi.as_view(),
        name="policy",
    ),
    path(
        "tenants/<slug:slug>/moderation/policy/update/",
        apis.ModerationPolicyUpdateApi.as_view(),
        name="policy-update",
    ),
    path(
        "tenants/<slug:slug>/moderation/events/",
        apis.ModerationEventListApi.as_view(),
        name="events",
    ),
]
