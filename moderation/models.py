"""A tenant's moderation policy and the events its checks record."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from moderation.policy import ACTIONS, OUTPUT_MODES, PII_ACTIONS


def _choices(values: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(v, v) for v in values]


class ModerationPolicy(models.Model):
    """One per tenant that moderates; a tenant without one is not moderated. The fields mean
    what ``moderation.policy.PolicySpec``'s do (that is what the gateways get)."""

    tenant = models.OneToOneField(
        "tenants.Tenant", on_delete=models.CASCADE, related_name="moderation_policy"
    )
    enabled = models.BooleanField(default=True)
    check_input = models.BooleanField(default=True)
    check_output = models.BooleanField(default=True)
    action = models.CharField(max_length=8, choices=_choices(ACTIONS), default="block")
    # {category: {"threshold": float, "action": "block"|"flag"|"log"}} for the categories on.
    categories = models.JSONField(default=dict, blank=True)
    deny_terms = models.JSONField(default=list, blank=True)
    regexes = models.JSONField(default=list, blank=True)
    pii_action = models.CharField(max_length=8, choices=_choices(PII_ACTIONS), default="off")
    classifier = models.BooleanField(default=True)
    guard_model = models.CharField(max_length=100, blank=True, default="")
    output_mode = models.CharField(max_length=8, choices=_choices(OUTPUT_MODES), default="async")
    window_tokens = models.PositiveIntegerField(
        default=64, validators=[MinValueValidator(4), MaxValueValidator(2048)]
    )
    overlap_tokens = models.PositiveIntegerField(default=16)
    fail_open = models.BooleanField(default=True)
    budget_ms = models.PositiveIntegerField(
        default=250, validators=[MinValueValidator(10), MaxValueValidator(10_000)]
    )
    store_text = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"moderation policy of {self.tenant_id}"


class ModerationEvent(models.Model):
    """What a check found on one request (one event per request and place at most, the
    strongest action), written by the gateways through a Redis stream."""

    class Where(models.TextChoices):
        INPUT = "input", "Input"
        OUTPUT = "output", "Output"

    event_id = models.CharField(max_length=64, unique=True)  # idempotent flushes
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    request_id = models.CharField(max_length=64, db_index=True)
    where = models.CharField(max_length=8, choices=Where.choices)
    action = models.CharField(max_length=8, choices=_choices(ACTIONS))
    categories = models.JSONField(default=list)
    rules = models.JSONField(default=list)
    failure = models.CharField(max_length=300, blank=True, default="")
    text = models.TextField(blank=True, default="")  # only when the tenant opted in
    key_prefix = models.CharField(max_length=32, blank=True, default="")
    created_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at"])]
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.action} on {self.where} of {self.request_id}"
