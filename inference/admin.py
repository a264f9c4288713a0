from typing import Any

from django.contrib import admin
from django.db import transaction
from django.forms import BaseInlineFormSet, ModelForm
from django.http import HttpRequest

from fleet.models import Model, Pool, Replica
from inference.catalog import catalog_publish
from inference.services import replica_name_assign


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin[Model]):
    list_display = ["name", "served_name", "context_length", "supports_lora", "is_public"]
    search_fields = ["name", "served_name"]
    filter_horizontal = ["allowed_tenants"]


class ReplicaInline(admin.TabularInline[Replica, Pool]):
    model = Replica
    extra = 0
    fields = ["name", "url", "state", "discovered", "vanished_at", "last_probe_at", "last_error"]
    readonly_fields = ["discovered", "vanished_at", "last_probe_at", "last_error"]


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin[Pool]):
    list_display = ["name", "kind", "model", "max_inflight", "policy", "discovery_url"]
    list_filter = ["kind", "policy", "discovery"]
    readonly_fields = ["discovery_error"]
    fieldsets = [
        (None, {"fields": ["name", "kind", "model", "max_inflight", "policy"]}),
        (
            "Admission and LoRA",
            {"fields": ["max_queue_wait_seconds", "lend_percent", "max_lora_rank", "max_loras"]},
        ),
        (
            "Replica discovery",
            {
                "description": "Static: the replicas below, registered by hand. DNS: every "
                "address of the name is a replica, re-resolved at every probe round (the "
                "replicas below marked discovered); ones registered by hand stay as they are.",
                "fields": [
                    "discovery",
                    "dns_name",
                    "dns_port",
                    "dns_scheme",
                    "drain_grace_seconds",
                    "discovery_error",
                ],
            },
        ),
    ]
    inlines = [ReplicaInline]

    def save_formset(
        self,
        request: HttpRequest,
        form: ModelForm[Pool],
        formset: BaseInlineFormSet[Any, Any, Any],
        change: bool,
    ) -> None:
        # New replicas left without a name get <pool>-<n>, as the services give them.
        with transaction.atomic():
            for replica_form in formset.forms:
                replica = replica_form.instance
                if (
                    isinstance(replica, Replica)
                    and replica_form.has_changed()
                    and not replica.name
                    and replica_form not in formset.deleted_forms
                ):
                    replica_name_assign(replica=replica)
            super().save_formset(request, form, formset, change)
        transaction.on_commit(catalog_publish)

    def save_model(
        self, request: HttpRequest, obj: Pool, form: ModelForm[Pool], change: bool
    ) -> None:
        super().save_model(request, obj, form, change)
        transaction.on_commit(catalog_publish)


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin[Replica]):
    list_display = ["name", "pool", "url", "state", "discovered", "last_probe_at", "last_error"]
    list_filter = ["state", "pool", "discovered"]
    search_fields = ["name", "url"]
    readonly_fields = ["discovered", "vanished_at", "last_probe_at", "last_error", "created_at"]

    def save_model(
        self, request: HttpRequest, obj: Replica, form: ModelForm[Replica], change: bool
    ) -> None:
        with transaction.atomic():
            if not obj.name:
                replica_name_assign(replica=obj)
            super().save_model(request, obj, form, change)
        transaction.on_commit(catalog_publish)
