from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from django.db import models


def _file_id() -> str:
    return "file-" + secrets.token_hex(12)


def _batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def epoch(when: datetime | None) -> int | None:
    return int(when.timestamp()) if when is not None else None


class File(models.Model):
    """A tenant's file: an uploaded batch input, or a batch's output or error file."""

    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    id = models.CharField(primary_key=True, max_length=40, default=_file_id, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    lines = models.IntegerField(default=0)
    path = models.CharField(max_length=300)  # in the default storage
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "created_at"], name="file_tenant_created")]

    def __str__(self) -> str:
        return self.id

    def to_openai(self) -> dict[str, Any]:
        shaped = {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": epoch(self.created_at),
            "expires_at": epoch(self.expires_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
        }
        return {name: value for name, value in shaped.items() if value is not None}


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    FINISHED = frozenset({Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED})

    id = models.CharField(primary_key=True, max_length=40, default=_batch_id, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    # The key the lines run with (its limits apply); a batch outlives neither key nor tenant.
    api_key = models.ForeignKey("tenants.ApiKey", on_delete=models.CASCADE, related_name="+")
    input_file_id = models.CharField(max_length=40)
    endpoint = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=8, default="24h")
    metadata = models.JSONField(null=True, blank=True)
    model = models.CharField(max_length=200, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING)
    errors = models.JSONField(null=True, blank=True)  # OpenAI's BatchError objects
    output_file_id = models.CharField(max_length=40, blank=True)
    error_file_id = models.CharField(max_length=40, blank=True)
    idempotency_key = models.CharField(max_length=255, blank=True)
    request_fingerprint = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # Internal leases, each held by one worker at a time: validating the file, running lines
    # (a turn: set to the turn's end when it ends), writing the files (its stamp: whoever
    # set it last writes). The first two also say when its tenant last had a turn.
    validating_until = models.DateTimeField(null=True, blank=True)
    running_until = models.DateTimeField(null=True, blank=True)
    ending_at = models.DateTimeField(null=True, blank=True)
    ending_as = models.CharField(max_length=16, blank=True)  # the status it is ending as
    # Its lines' tokens as a quota counts them (batches.quotas), set when it is validated.
    estimated_tokens = models.BigIntegerField(default=0)
    # Its request counts and usage, kept when its lines are deleted after the retention
    # period (batches_purge); until then they are read from the lines.
    kept = models.JSONField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "created_at"], name="batch_tenant_created"),
            models.Index(fields=["status"], name="batch_status"),
            # Whose turn it is (batches.turns): each tenant's latest validation and run.
            models.Index(fields=["tenant", "validating_until"], name="batch_tenant_validated"),
            models.Index(fields=["tenant", "running_until"], name="batch_tenant_ran"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="batch_idempotency_key_unique",
            )
        ]

    def __str__(self) -> str:
        return self.id


class Line(models.Model):
    """One request of a batch, and once it ran, its result. A line is stored once (unique on
    batch and line number); only the worker holding its claim (``owner``) may store it."""

    class State(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"  # answered 200: goes to the output file
        FAILED = "failed"  # answered an error: goes to the error file
        CANCELLED = "cancelled"  # never started: the batch was cancelled
        EXPIRED = "expired"  # not finished inside the completion window

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    number = models.IntegerField()  # 1-based line of the input file
    custom_id = models.CharField(max_length=512)
    body = models.JSONField()
    size = models.IntegerField(default=0)  # the line's bytes in its file (bounds what runs)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    owner = models.CharField(max_length=64, blank=True)  # the claim token while running
    lease_until = models.DateTimeField(null=True, blank=True)
    attempts = models.IntegerField(default=0)
    # Passing failures after it reached an engine (batches.runner: bounded).
    failures = models.IntegerField(default=0)
    result_id = models.CharField(max_length=40, blank=True)  # "batch_req_…"
    status_code = models.IntegerField(null=True, blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    response = models.JSONField(null=True, blank=True)
    prompt_tokens = models.IntegerField(default=0)
    completion_tokens = models.IntegerField(default=0)
    cached_tokens = models.IntegerField(default=0)
    # What the line's records (its own, its guard's) cost, in micro-dollars: as the ledger
    # prices them, fixed when the line is stored (batches.runner). 0 for lines stored before.
    cost_micros = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["batch", "number"], name="line_batch_number_unique"),
            models.UniqueConstraint(fields=["batch", "custom_id"], name="line_batch_custom_unique"),
        ]
        indexes = [models.Index(fields=["batch", "state"], name="line_batch_state")]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.number}"
