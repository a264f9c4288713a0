from django.contrib import admin

from inference.models import Model, Pool, Replica


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin[Model]):
    list_display = ["name", "served_name", "context_length", "supports_lora", "is_public"]
    search_fields = ["name", "served_name"]
    filter_horizontal = ["allowed_tenants"]


class ReplicaInline(admin.TabularInline[Replica, Pool]):
    model = Replica
    extra = 0
    readonly_fields = ["last_probe_at", "last_error"]


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin[Pool]):
    list_display = ["name", "kind", "model", "max_inflight", "policy"]
    list_filter = ["kind", "policy"]
    inlines = [ReplicaInline]


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin[Replica]):
    list_display = ["pool", "url", "state", "last_probe_at", "last_error"]
    list_filter = ["state", "pool"]
    readonly_fields = ["last_probe_at", "last_error"]
