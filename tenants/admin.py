"""Django admin for platform staff. Writes go through the services so they are audited."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest

from tenants import services
from tenants.models import ApiKey, AuditEvent, LimitFields, Membership, Tenant, User

admin.site.site_header = "Inferplane operations"
admin.site.site_title = "Inferplane"

admin.site.register(User, UserAdmin)


class MembershipInline(admin.TabularInline[Membership, Tenant]):
    model = Membership
    extra = 0
    fields = ["user", "role", "created_at"]
    readonly_fields = ["user", "role", "created_at"]
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # members are managed through the control API and dashboard (audited)


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin[Tenant]):
    list_display = ["slug", "name", "status", "weight", "rpm", "tpm", "max_concurrency"]
    list_filter = ["status"]
    search_fields = ["slug", "name"]
    readonly_fields = ["created_at", "updated_at"]
    inlines = [MembershipInline]

    def get_readonly_fields(self, request: HttpRequest, obj: Tenant | None = None) -> list[str]:
        return [*self.readonly_fields, "slug"] if obj else list(self.readonly_fields)

    def save_model(
        self, request: HttpRequest, obj: Tenant, form: ModelForm[Tenant], change: bool
    ) -> None:
        actor = request.user if isinstance(request.user, User) else None
        limits = {name: getattr(obj, name) for name in LimitFields.LIMIT_NAMES}
        if not change:
            services.tenant_create(
                slug=obj.slug, name=obj.name, weight=obj.weight, limits=limits, actor=actor
            )
            return
        current = Tenant.objects.get(pk=obj.pk)
        services.tenant_update(
            tenant=current, actor=actor, name=obj.name, status=obj.status, weight=obj.weight
        )
        services.tenant_limits_update(tenant=current, actor=actor, limits=limits)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # suspend instead: usage and invoices must keep their tenant


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    list_display = ["display_prefix", "name", "tenant", "status", "created_by", "last_used_at"]
    list_filter = ["tenant"]
    search_fields = ["prefix", "name", "tenant__slug"]
    actions = ["revoke"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in ApiKey._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a key's secret is shown once, by the control API or the dashboard

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        actor = request.user if isinstance(request.user, User) else None
        for key in queryset.select_related("tenant"):
            services.api_key_revoke(api_key=key, actor=actor)
        messages.success(request, f"Revoked {queryset.count()} key(s).")


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin[AuditEvent]):
    list_display = ["created_at", "tenant", "actor_label", "action", "target_label"]
    list_filter = ["action", "tenant"]
    search_fields = ["actor_label", "action", "target_label"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in AuditEvent._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
