"""Django admin for platform staff: the price book (add-only: history is never edited) and
read-only views of the ledger and its rollups."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import admin
from django.forms import ModelForm
from django.http import HttpRequest
from django.utils import timezone

from billing import services
from billing.models import DailyUsage, Invoice, InvoiceLine, Price, UsageRecord
from tenants.models import User


class PriceForm(forms.ModelForm[Price]):
    # The priority classes' rates: blank is 0 (standard pays the price as it is).
    interactive_surcharge_percent = forms.DecimalField(
        required=False, min_value=0, max_digits=5, decimal_places=2, initial=0
    )
    background_discount_percent = forms.DecimalField(
        required=False, min_value=0, max_value=100, max_digits=5, decimal_places=2, initial=0
    )

    class Meta:
        model = Price
        fields = [
            "model",
            "tenant",
            "input_per_mtok",
            "cached_input_per_mtok",
            "output_per_mtok",
            "batch_discount_percent",
            "interactive_surcharge_percent",
            "background_discount_percent",
            "effective_from",
        ]

    def clean_interactive_surcharge_percent(self) -> Decimal:
        return self.cleaned_data["interactive_surcharge_percent"] or Decimal(0)

    def clean_background_discount_percent(self) -> Decimal:
        return self.cleaned_data["background_discount_percent"] or Decimal(0)

    def clean_effective_from(self) -> Any:
        value = self.cleaned_data["effective_from"]
        if value and value < timezone.now() - timedelta(minutes=1):
            raise forms.ValidationError(
                "A price cannot start in the past: usage already written keeps its price."
            )
        return value


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin[Price]):
    form = PriceForm
    list_display = [
        "model",
        "tenant",
        "input_per_mtok",
        "cached_input_per_mtok",
        "output_per_mtok",
        "batch_discount_percent",
        "effective_from",
    ]
    list_filter = ["model"]
    search_fields = ["model__name", "tenant__slug"]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a price in the book is history; a new price is a new row

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(
        self, request: HttpRequest, obj: Price, form: ModelForm[Price], change: bool
    ) -> None:
        created = services.price_set(
            model=obj.model,
            tenant=obj.tenant,
            input_per_mtok=obj.input_per_mtok,
            cached_input_per_mtok=obj.cached_input_per_mtok,
            output_per_mtok=obj.output_per_mtok,
            batch_discount_percent=obj.batch_discount_percent,
            interactive_surcharge_percent=obj.interactive_surcharge_percent,
            background_discount_percent=obj.background_discount_percent,
            effective_from=obj.effective_from,
            actor=request.user if isinstance(request.user, User) else None,
        )
        obj.pk = created.pk


class _ReadOnly(admin.ModelAdmin[Any]):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(_ReadOnly):
    list_display = [
        "request_id",
        "tenant",
        "model",
        "mode",
        "status",
        "prompt_tokens",
        "completion_tokens",
        "cost_micros",
        "started_at",
    ]
    list_filter = ["mode", "status"]
    search_fields = ["request_id", "tenant__slug"]
    date_hierarchy = "started_at"
    show_full_result_count = False  # the ledger is large: no COUNT(*) per page


@admin.register(DailyUsage)
class DailyUsageAdmin(_ReadOnly):
    list_display = [
        "day",
        "tenant",
        "model",
        "mode",
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "cost_micros",
    ]
    list_filter = ["mode"]
    search_fields = ["tenant__slug", "model"]


class InvoiceLineInline(admin.TabularInline[InvoiceLine, Invoice]):
    model = InvoiceLine
    extra = 0
    can_delete = False
    fields = readonly_fields = (
        "model",
        "mode",
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "amount_cents",
    )

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Invoice)
class InvoiceAdmin(_ReadOnly):
    """Read-only: finalize and void through the control API or ``finalize_invoices``."""

    list_display = ["tenant", "period_start", "status", "total_cents", "stripe_status", "paid_at"]
    list_filter = ["status", "period_start"]
    search_fields = ["tenant__slug", "stripe_invoice_id"]
    inlines = [InvoiceLineInline]
