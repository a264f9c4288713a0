from __future__ import annotations

from django.db import models


class UsageRecord(models.Model):
    """One served request, as the engine counted it. Immutable; ``request_id`` is unique.

    Written in batches from the Redis spool the gateway fills (never on the request path),
    idempotently: replaying the spool cannot double-count.
    """

    class Mode(models.TextChoices):
        ONLINE = "online", "Online"
        BATCH = "batch", "Batch"

    class Status(models.TextChoices):
        OK = "ok", "Completed"
        CUT_OFF = "cut_off", "Cut off (client left)"
        ERROR = "error", "Error"
        CONTENT_FILTER = "content_filter", "Stopped by moderation"

    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    api_key = models.ForeignKey(
        "tenants.ApiKey", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, blank=True)
    endpoint = models.CharField(max_length=32)
    mode = models.CharField(max_length=8, choices=Mode.choices, default=Mode.ONLINE)
    status = models.CharField(max_length=16, choices=Status.choices)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    cost_micros = models.BigIntegerField(null=True, blank=True)
    pool = models.CharField(max_length=64, blank=True)
    replica = models.CharField(max_length=200, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    duration_ms = models.PositiveIntegerField(default=0)
    error = models.CharField(max_length=300, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "started_at"], name="usage_tenant_started"),
            models.Index(fields=["started_at"], name="usage_started"),
        ]

    def __str__(self) -> str:
        return self.request_id

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
