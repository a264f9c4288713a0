from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import forms
from django.contrib.auth.forms import UserCreationForm
from django.core.files import File

from tenants.models import ApiKey, Role, Tenant, User, adapter_name_validator


class KeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What the key is for, e.g. “support bot”.")
    scopes = forms.MultipleChoiceField(
        choices=ApiKey.Scope.choices,
        initial=list(ApiKey.Scope.values),
        widget=forms.CheckboxSelectMultiple,
    )


class KeyRotateForm(forms.Form):
    grace_hours = forms.IntegerField(
        min_value=0,
        max_value=30 * 24,
        initial=24,
        label="Old key keeps working for (hours)",
    )


class AdapterUploadForm(forms.Form):
    name = forms.CharField(max_length=63, validators=[adapter_name_validator])
    archive = forms.FileField(required=False, help_text=".zip or .tar.gz")
    adapter_config = forms.FileField(required=False, label="adapter_config.json")
    adapter_model = forms.FileField(required=False, label="adapter_model.safetensors")

    def files_given(self) -> dict[str, File[Any]]:
        return {
            part: self.cleaned_data[part]
            for part in ("archive", "adapter_config", "adapter_model")
            if self.cleaned_data.get(part)
        }


class InviteForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices, initial=Role.DEVELOPER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


class SignUpForm(UserCreationForm[User]):
    """A new account, made while accepting an invitation."""

    class Meta(UserCreationForm.Meta):
        model = User
        fields = ("username", "email")


class AuditFilterForm(forms.Form):
    action = forms.CharField(required=False, max_length=64, label="Action starts with")
    actor = forms.CharField(required=False, max_length=150)
    since = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}))


class UsageFilterForm(forms.Form):
    """The usage explorer's selection. Dates are UTC days, both ends included."""

    MAX_DAYS = 366

    start = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}))
    model = forms.CharField(required=False, max_length=200)
    key = forms.IntegerField(required=False, min_value=1, label="API key")
    mode = forms.ChoiceField(
        required=False, choices=[("", "online and batch"), ("online", "online"), ("batch", "batch")]
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        start, end = data.get("start"), data.get("end")
        if start and end:
            if end < start:
                self.add_error("end", "Must be on or after the start.")
            elif (end - start).days >= self.MAX_DAYS:
                self.add_error("end", f"Choose at most {self.MAX_DAYS} days.")
        return data


class TenantLimitsForm(forms.Form):
    """Platform staff set a tenant's limits (blank: unlimited), fair-share weight and status."""

    rpm = forms.IntegerField(required=False, min_value=1, label="Requests per minute")
    tpm = forms.IntegerField(required=False, min_value=1, label="Tokens per minute")
    max_concurrency = forms.IntegerField(required=False, min_value=1, label="Requests in flight")
    max_tokens_per_request = forms.IntegerField(
        required=False, min_value=1, label="max_tokens per request"
    )
    monthly_token_budget = forms.IntegerField(
        required=False, min_value=1, label="Monthly token budget"
    )
    monthly_spend_budget_usd = forms.DecimalField(
        required=False,
        min_value=Decimal("0.01"),
        decimal_places=2,
        label="Monthly spend budget (USD)",
    )
    weight = forms.IntegerField(min_value=1, max_value=1000, label="Fair-share weight")
    status = forms.ChoiceField(choices=Tenant.Status.choices)

    LIMITS = ("rpm", "tpm", "max_concurrency", "max_tokens_per_request", "monthly_token_budget")

    @classmethod
    def for_tenant(cls, tenant: Tenant) -> TenantLimitsForm:
        budget = tenant.monthly_spend_budget_micros
        initial: dict[str, Any] = {name: getattr(tenant, name) for name in cls.LIMITS}
        initial["monthly_spend_budget_usd"] = (
            Decimal(budget) / 1_000_000 if budget is not None else None
        )
        initial.update(weight=tenant.weight, status=tenant.status)
        return cls(initial=initial)

    def limits(self) -> dict[str, int | None]:
        data = self.cleaned_data
        limits: dict[str, int | None] = {name: data[name] for name in self.LIMITS}
        usd = data["monthly_spend_budget_usd"]
        limits["monthly_spend_budget_micros"] = int(usd * 1_000_000) if usd is not None else None
        return limits
