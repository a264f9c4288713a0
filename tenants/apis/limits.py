"""The limits' wire shapes, shared by tenants and keys (rates, budgets in dollars)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from rest_framework import serializers

from tenants.models import (
    MAX_BUDGET,
    MAX_RATE,
    ApiKey,
    LimitFields,
    Tenant,
    tighter,
)

MICROS = Decimal(1_000_000)


# --- Limits (shared by tenants and keys) -----------------------------------------------------


def _limit_field() -> serializers.IntegerField:
    return serializers.IntegerField(
        min_value=1, max_value=MAX_RATE, allow_null=True, required=False
    )


class LimitsInputSerializer(serializers.Serializer[Any]):
    """Send only what changes; ``null`` means unlimited."""

    rpm = _limit_field()
    tpm = _limit_field()
    max_concurrency = _limit_field()
    max_tokens_per_request = _limit_field()
    monthly_token_budget = serializers.IntegerField(
        min_value=1, max_value=MAX_BUDGET, allow_null=True, required=False
    )
    monthly_spend_budget_usd = serializers.DecimalField(
        max_digits=18,
        decimal_places=6,
        min_value=Decimal("0.000001"),
        max_value=Decimal(MAX_BUDGET) / MICROS,
        allow_null=True,
        required=False,
    )

    def to_limits(self) -> dict[str, int | None]:
        """The limits that were sent, in the model's units."""
        data = self.validated_data
        limits = {k: data[k] for k in LimitFields.LIMIT_NAMES if k in data}
        if "monthly_spend_budget_usd" in data:
            usd = data["monthly_spend_budget_usd"]
            limits["monthly_spend_budget_micros"] = None if usd is None else int(usd * MICROS)
        return limits


class LimitsOutputSerializer(serializers.Serializer[Any]):
    rpm = serializers.IntegerField(allow_null=True)
    tpm = serializers.IntegerField(allow_null=True)
    max_concurrency = serializers.IntegerField(allow_null=True)
    max_tokens_per_request = serializers.IntegerField(allow_null=True)
    monthly_token_budget = serializers.IntegerField(allow_null=True)
    monthly_spend_budget_usd = serializers.SerializerMethodField()

    def get_monthly_spend_budget_usd(self, obj: LimitFields) -> str | None:
        micros = obj.monthly_spend_budget_micros
        return None if micros is None else str(Decimal(micros) / MICROS)


class TenantLimitsInputSerializer(LimitsInputSerializer):
    """A tenant's limits, and its quotas on files and batches (``null``: the default)."""

    storage_mb = _limit_field()
    max_open_batches = _limit_field()
    batch_queue_tokens = serializers.IntegerField(
        min_value=1, max_value=MAX_BUDGET, allow_null=True, required=False
    )

    def to_limits(self) -> dict[str, int | None]:
        data = self.validated_data
        return super().to_limits() | {k: data[k] for k in Tenant.QUOTA_NAMES if k in data}


class TenantLimitsOutputSerializer(LimitsOutputSerializer):
    """The quotas as they apply; ``quotas_by_default`` names those the tenant takes from the
    platform's defaults."""

    storage_mb = serializers.SerializerMethodField()
    max_open_batches = serializers.SerializerMethodField()
    batch_queue_tokens = serializers.SerializerMethodField()
    quotas_by_default = serializers.SerializerMethodField()

    def get_storage_mb(self, obj: Tenant) -> int:
        return obj.quota("storage_mb")

    def get_max_open_batches(self, obj: Tenant) -> int:
        return obj.quota("max_open_batches")

    def get_batch_queue_tokens(self, obj: Tenant) -> int:
        return obj.quota("batch_queue_tokens")

    def get_quotas_by_default(self, obj: Tenant) -> list[str]:
        return [name for name in Tenant.QUOTA_NAMES if getattr(obj, name) is None]


def effective(key: ApiKey) -> dict[str, Any]:
    """The limits a key actually gets: the tighter of its own and its tenant's."""
    result: dict[str, Any] = {}
    for name in LimitFields.LIMIT_NAMES:
        result[name] = tighter(getattr(key, name), getattr(key.tenant, name))
    micros = result.pop("monthly_spend_budget_micros")
    result["monthly_spend_budget_usd"] = None if micros is None else str(Decimal(micros) / MICROS)
    return result
