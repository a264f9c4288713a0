from __future__ import annotations

from decimal import Decimal
from typing import Any, cast

from django import forms
from django.contrib.auth.forms import UserCreationForm
from django.core.files import File
from django.db.models import QuerySet

from adapters.models import adapter_name_validator
from batches.wire import ENDPOINTS
from fleet.models import Model, Pool
from tenants.models import MAX_BUDGET, MAX_RATE, ApiKey, Role, Tenant, User
from tenants.priority import DEFAULT_CLASS, PriorityClass


class KeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What the key is for, e.g. “support bot”.")
    scopes = forms.MultipleChoiceField(
        choices=ApiKey.Scope.choices,
        initial=list(ApiKey.Scope.values),
        widget=forms.CheckboxSelectMultiple,
    )
    expires_in_days = forms.IntegerField(
        required=False, min_value=1, max_value=3650, label="Expires after (days)"
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


class LimitsForm(forms.Form):
    """Limits and budgets, blank for unlimited, with the control API's bounds
    (``tenants.apis.limits.LimitsInputSerializer``): a tenant's or a key's."""

    rpm = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_RATE, label="Requests per minute"
    )
    tpm = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_RATE, label="Tokens per minute"
    )
    max_concurrency = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_RATE, label="Requests in flight"
    )
    max_tokens_per_request = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_RATE, label="max_tokens per request"
    )
    monthly_token_budget = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_BUDGET, label="Monthly token budget"
    )
    monthly_spend_budget_usd = forms.DecimalField(
        required=False,
        min_value=Decimal("0.000001"),
        max_value=Decimal(MAX_BUDGET) / 1_000_000,
        decimal_places=6,
        label="Monthly spend budget (USD)",
    )

    LIMITS = ("rpm", "tpm", "max_concurrency", "max_tokens_per_request", "monthly_token_budget")

    @staticmethod
    def initial_for(obj: Tenant | ApiKey) -> dict[str, Any]:
        budget = obj.monthly_spend_budget_micros
        initial: dict[str, Any] = {name: getattr(obj, name) for name in LimitsForm.LIMITS}
        initial["monthly_spend_budget_usd"] = (
            Decimal(budget) / 1_000_000 if budget is not None else None
        )
        return initial

    def limits(self) -> dict[str, int | None]:
        data = self.cleaned_data
        limits: dict[str, int | None] = {name: data[name] for name in self.LIMITS}
        usd = data["monthly_spend_budget_usd"]
        limits["monthly_spend_budget_micros"] = int(usd * 1_000_000) if usd is not None else None
        return limits


class KeyLimitsForm(LimitsForm):
    """Owners and admins narrow one key inside its tenant's limits (blank: the tenant's), and
    its priority class below its tenant's (docs/priority.md)."""

    priority_class = forms.ChoiceField(
        required=False,
        choices=[("", "The tenant's"), *PriorityClass.choices],
        label="Priority class",
    )

    @classmethod
    def for_key(cls, key: ApiKey) -> KeyLimitsForm:
        initial = cls.initial_for(key)
        initial.update(priority_class=key.priority_class)
        return cls(initial=initial)


class TenantLimitsForm(LimitsForm):
    """Platform staff set a tenant's limits (blank: unlimited), fair-share weight and status."""

    storage_mb = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_RATE, label="Stored files (MiB)"
    )
    max_open_batches = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_RATE, label="Open batches"
    )
    batch_queue_tokens = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_BUDGET, label="Batch tokens queued"
    )
    weight = forms.IntegerField(min_value=1, max_value=1000, label="Fair-share weight")
    priority_class = forms.ChoiceField(
        required=False,
        choices=[("", "Unchanged"), *PriorityClass.choices],
        label="Priority class",
    )
    status = forms.ChoiceField(choices=Tenant.Status.choices)

    @classmethod
    def for_tenant(cls, tenant: Tenant) -> TenantLimitsForm:
        initial = cls.initial_for(tenant)
        initial.update({name: getattr(tenant, name) for name in Tenant.QUOTA_NAMES})
        initial.update(
            weight=tenant.weight, priority_class=tenant.priority_class, status=tenant.status
        )
        return cls(initial=initial)

    def limits(self) -> dict[str, int | None]:
        limits = super().limits()
        limits.update({name: self.cleaned_data[name] for name in Tenant.QUOTA_NAMES})
        return limits


class ModerationPolicyForm(forms.Form):
    """A tenant's moderation policy as its admins edit it (``moderation.services``)."""

    enabled = forms.BooleanField(required=False, label="Moderate this tenant's requests")
    check_input = forms.BooleanField(required=False, label="Check prompts")
    check_output = forms.BooleanField(required=False, label="Check answers")
    action = forms.ChoiceField(
        choices=[("block", "block"), ("flag", "flag"), ("log", "log")],
        label="Action (deny terms, regexes, every category)",
    )
    threshold = forms.FloatField(min_value=0.0, max_value=1.0, label="Category threshold")
    deny_terms = forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 4}), label="Deny terms (one a line)"
    )
    regexes = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        label="Regexes (RE2, one a line)",
    )
    pii_action = forms.ChoiceField(
        choices=[(a, a) for a in ("off", "block", "mask", "log")],
        label="Card numbers and IBANs",
    )
    classifier = forms.BooleanField(required=False, label="Embedded classifier (harassment)")
    guard_model = forms.CharField(required=False, max_length=100, label="Guard model")
    output_mode = forms.ChoiceField(
        choices=[("async", "async: tokens at once, cut within a window"),
                 ("hold", "hold: nothing unchecked reaches the client")],
        label="Output mode",
    )  # fmt: skip
    window_tokens = forms.IntegerField(min_value=4, max_value=2048, label="Window (tokens)")
    overlap_tokens = forms.IntegerField(min_value=0, max_value=2047, label="Overlap (tokens)")
    fail_open = forms.BooleanField(required=False, label="Fail open when a check fails")
    budget_ms = forms.IntegerField(min_value=10, max_value=10_000, label="Time budget (ms)")
    store_text = forms.BooleanField(required=False, label="Keep the text that fired in events")

    FIELDS = (
        "enabled", "check_input", "check_output", "action", "pii_action", "classifier",
        "guard_model", "output_mode", "window_tokens", "overlap_tokens", "fail_open",
        "budget_ms", "store_text",
    )  # fmt: skip

    @classmethod
    def initial_for(cls, policy: Any) -> dict[str, Any]:
        if policy is None:  # off, as the tenant is; the rest is what ticking it turns on
            return {
                "enabled": False, "check_input": True, "check_output": True, "action": "block",
                "threshold": 0.8, "pii_action": "off", "classifier": True, "output_mode": "async",
                "window_tokens": 64, "overlap_tokens": 16, "fail_open": True, "budget_ms": 250,
            }  # fmt: skip
        thresholds = [rule["threshold"] for rule in (policy.categories or {}).values()]
        return {
            **{name: getattr(policy, name) for name in cls.FIELDS},
            "threshold": max(thresholds) if thresholds else 0.8,
            "deny_terms": "\n".join(policy.deny_terms),
            "regexes": "\n".join(policy.regexes),
        }

    def changes(self, categories: list[str]) -> dict[str, Any]:
        data = self.cleaned_data
        out = {name: data[name] for name in self.FIELDS}
        out["deny_terms"] = [t.strip() for t in data["deny_terms"].splitlines() if t.strip()]
        out["regexes"] = [r for r in (line.strip() for line in data["regexes"].splitlines()) if r]
        out["categories"] = {
            name: {"threshold": data["threshold"], "action": data["action"]} for name in categories
        }
        return out


class CacheForm(forms.Form):
    """The tenant's response cache (``tenants.services.tenant_cache_update``)."""

    mode = forms.ChoiceField(choices=Tenant.Cache.choices, label="Response cache")
    ttl_seconds = forms.IntegerField(
        min_value=60, max_value=30 * 86400, label="Serve an answer for (seconds)"
    )
    threshold = forms.FloatField(
        min_value=0.5, max_value=1.0, label="Semantic: similarity a hit needs"
    )
    embedding_model = forms.CharField(
        required=False, max_length=200, label="Semantic: embedding model"
    )


class TenantCreateForm(forms.Form):
    """A new tenant as the operator makes it (``tenants.services.tenant_create``, as
    ``POST /api/tenants/``); its limits are set on its limits page next."""

    slug = forms.SlugField(max_length=40, help_text="In URLs and adapter names: a-z, 0-9, -.")
    name = forms.CharField(max_length=200, required=False)
    weight = forms.IntegerField(min_value=1, max_value=1000, initial=1, label="Fair-share weight")
    priority_class = forms.ChoiceField(
        required=False,
        choices=PriorityClass.choices,
        initial=DEFAULT_CLASS,
        label="Priority class",
    )


class PoolForm(forms.ModelForm[Pool]):
    """A pool's admission settings as the operator changes them (``pool_configure``, as
    ``configure_pool`` and the control API do): the fields and their bounds are the model's.
    Only read: the view saves through the service, never ``form.save()``."""

    replicas_from = forms.CharField(
        max_length=300,
        label="Replicas from",
        help_text="static (registered by hand), or http(s)://SERVICE-NAME:PORT: every address "
        "of that DNS name is a replica.",
    )

    class Meta:
        model = Pool
        fields = [
            "max_inflight",
            "policy",
            "max_queue_wait_seconds",
            "max_loras",
            "max_lora_rank",
            "drain_grace_seconds",
            "lend_percent",
        ]
        labels = {
            "max_inflight": "Max in flight per replica",
            "max_queue_wait_seconds": "Max queue wait (s)",
            "max_loras": "Adapters per replica",
            "max_lora_rank": "Max adapter rank",
            "drain_grace_seconds": "Drain grace (s)",
            "lend_percent": "Lend to batch work (%)",
        }


class KeyChoiceField(forms.ModelChoiceField):  # type: ignore[type-arg]
    """An API key by its name and prefix."""

    def label_from_instance(self, obj: ApiKey) -> str:
        return f"{obj.name} ({obj.display_prefix})"


class BatchUploadForm(forms.Form):
    """A batch input file sent from the dashboard: stored as ``POST /v1/files`` stores it, then
    the batch made as ``POST /v1/batches`` makes it, for the key chosen (its limits, budget
    and usage are the batch's, as if that key had sent it)."""

    file = forms.FileField(
        label="Input file (.jsonl)", widget=forms.FileInput(attrs={"accept": ".jsonl"})
    )
    endpoint = forms.ChoiceField(choices=[(e, e) for e in sorted(ENDPOINTS)])
    api_key = KeyChoiceField(queryset=ApiKey.objects.none(), label="Run as key", empty_label=None)
    description = forms.CharField(
        max_length=512, required=False, label="Description (metadata, optional)"
    )

    def __init__(self, *args: Any, keys: QuerySet[ApiKey], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cast(KeyChoiceField, self.fields["api_key"]).queryset = keys
        self.fields["endpoint"].initial = "/v1/chat/completions"


class ReplicaAddForm(forms.Form):
    url = forms.CharField(max_length=200, label="Engine URL", help_text="e.g. http://10.0.0.5:8000")
    name = forms.CharField(max_length=64, required=False, label="Name (blank: <pool>-<n>)")


class BlankIsZeroPercent(forms.DecimalField):
    """A percentage, 0 when left blank (a class's surcharge or discount on a price)."""

    def __init__(self, *, label: str, max_value: int | None = 100) -> None:
        super().__init__(
            required=False,
            min_value=0,
            max_value=max_value,
            max_digits=5,
            decimal_places=2,
            initial=0,
            label=label,
        )

    def clean(self, value: Any) -> Decimal:
        return super().clean(value) or Decimal(0)


class PriceForm(forms.Form):
    """A price as the operator adds it (``billing.services.price_set``, as ``set_price``):
    dollars per 1M tokens, in force from now or a later moment."""

    model = forms.ModelChoiceField(queryset=Model.objects.order_by("name"), to_field_name="name")
    tenant = forms.SlugField(required=False, max_length=40, label="Tenant (blank: the list price)")
    input_per_mtok = forms.DecimalField(
        min_value=0, max_digits=14, decimal_places=6, label="Input $/1M"
    )
    cached_input_per_mtok = forms.DecimalField(
        required=False,
        min_value=0,
        max_digits=14,
        decimal_places=6,
        label="Cached input $/1M (blank: as input)",
    )
    output_per_mtok = forms.DecimalField(
        min_value=0, max_digits=14, decimal_places=6, label="Output $/1M"
    )
    batch_discount_percent = forms.DecimalField(
        min_value=0, max_value=100, decimal_places=2, initial=0, label="Batch discount %"
    )
    interactive_surcharge_percent = BlankIsZeroPercent(
        max_value=None, label="Interactive surcharge % (blank: 0)"
    )
    background_discount_percent = BlankIsZeroPercent(label="Background discount % (blank: 0)")
    effective_from = forms.DateTimeField(
        required=False, label="From (UTC, blank: now)", help_text="2026-12-01 00:00"
    )

    def clean_tenant(self) -> Tenant | None:
        slug = self.cleaned_data["tenant"]
        if not slug:
            return None
        found = Tenant.objects.filter(slug=slug).first()
        if found is None:
            raise forms.ValidationError(f"No tenant with slug {slug!r}.")
        return found


class RouteForm(forms.Form):
    """A model route as an operator types it: the name, and ``TARGET=WEIGHT ...``."""

    name = forms.CharField(max_length=200)
    targets = forms.CharField(
        max_length=2000,
        help_text="TARGET=WEIGHT, separated by spaces: tiny-chat=90 tiny-chat-next=10. "
        "Moving every weight to one target is the rollback (or the promotion).",
    )

    def clean_targets(self) -> list[tuple[str, int]]:
        parsed = []
        for pair in self.cleaned_data["targets"].split():
            target, sep, weight = pair.rpartition("=")
            if not sep or not target or not weight.isdigit():
                raise forms.ValidationError(f"{pair}: write each target as TARGET=WEIGHT.")
            parsed.append((target, int(weight)))
        if not parsed:
            raise forms.ValidationError("Give at least one TARGET=WEIGHT.")
        return parsed
