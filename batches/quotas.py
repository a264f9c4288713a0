"""A tenant's quotas on what it keeps and queues: stored bytes, open batches, batch tokens
queued. Each is checked under a lock on the tenant's row, so two requests at once cannot
both fit in the last of a quota (docs/isolation.md). Past one: OpenAI's error shape, with
the quota's name and size, and nothing stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from django.db.models import Sum

from batches.models import Batch, File
from inference.gateway.errors import ApiError
from tenants.models import Tenant

MIB = 1024 * 1024
# A batch's tokens stop counting as queued once it is finishing: its lines are done.
QUEUED = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING)
# What a token costs in characters when it is estimated, not counted: no tokenizer runs at
# validation (the engines have it). Four is the usual figure for English text.
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class QuotaUse:
    name: str
    label: str
    used: int
    quota: int
    unit: str


def tenant_locked(tenant_id: int) -> Tenant:
    """The tenant's row, locked to the end of the caller's transaction: quota checks of one
    tenant take turns. ``FOR NO KEY UPDATE``: rows that refer to the tenant (usage records,
    written for many tenants in one transaction) are still inserted meanwhile."""
    return Tenant.objects.select_for_update(no_key=True).get(pk=tenant_id)


def stored_bytes(*, tenant_id: int) -> int:
    used: int = File.objects.filter(tenant_id=tenant_id).aggregate(b=Sum("bytes", default=0))["b"]
    return used


def open_batches(*, tenant_id: int) -> int:
    return Batch.objects.filter(tenant_id=tenant_id).exclude(status__in=Batch.FINISHED).count()


def queued_tokens(*, tenant_id: int, excluding: str = "") -> int:
    queued = Batch.objects.filter(tenant_id=tenant_id, status__in=QUEUED).exclude(pk=excluding)
    total: int = queued.aggregate(t=Sum("estimated_tokens", default=0))["t"]
    return total


def quota_use(tenant: Tenant) -> list[QuotaUse]:
    """Each quota beside what the tenant uses of it now (the dashboard, the control API)."""
    return [
        QuotaUse(
            "storage_mb",
            "Stored files",
            stored_bytes(tenant_id=tenant.pk),
            tenant.quota("storage_mb") * MIB,
            "bytes",
        ),
        QuotaUse(
            "max_open_batches",
            "Open batches",
            open_batches(tenant_id=tenant.pk),
            tenant.quota("max_open_batches"),
            "batches",
        ),
        QuotaUse(
            "batch_queue_tokens",
            "Batch tokens queued",
            queued_tokens(tenant_id=tenant.pk),
            tenant.quota("batch_queue_tokens"),
            "tokens",
        ),
    ]


def _over(code: str, message: str, param: str | None = None) -> ApiError:
    # 400, not 429: OpenAI's SDKs retry a 429 on their own, and this does not pass by waiting.
    return ApiError(400, message, type="invalid_request_error", code=code, param=param)


def storage_check(tenant: Tenant, adding: int) -> None:
    """Raises unless ``adding`` more bytes fit in the tenant's storage quota."""
    quota = tenant.quota("storage_mb")
    used = stored_bytes(tenant_id=tenant.pk)
    if used + adding > quota * MIB:
        raise _over(
            "storage_quota_exceeded",
            f"This file ({adding / MIB:,.1f} MiB) does not fit in the tenant's storage quota of "
            f"{quota:,} MiB ({used / MIB:,.1f} MiB in use by its files and batch outputs). "
            "Delete files you no longer need, or ask the operator for a larger quota.",
            param="file",
        )


def open_batches_check(tenant: Tenant) -> None:
    """Raises unless the tenant may open one more batch: under its quota of open batches,
    and of storage (its output files will need room; those of running batches are always
    written, so a tenant over its storage starts no more)."""
    storage_check(tenant, 0)
    quota = tenant.quota("max_open_batches")
    if open_batches(tenant_id=tenant.pk) >= quota:
        raise _over(
            "open_batches_quota_exceeded",
            f"The tenant has {quota:,} batches not yet finished, its quota of open batches. "
            "Wait for one to finish (or cancel one), or ask the operator for a larger quota.",
        )


def queue_tokens_over(tenant: Tenant, batch: Batch) -> str | None:
    """Why the batch's estimated tokens do not fit beside the tenant's other queued batches,
    or None when they do (OpenAI fails such a batch with ``token_limit_exceeded``)."""
    quota = tenant.quota("batch_queue_tokens")
    queued = queued_tokens(tenant_id=tenant.pk, excluding=batch.pk)
    if queued + batch.estimated_tokens <= quota:
        return None
    return (
        f"Enqueued token limit reached: this batch is an estimated "
        f"{batch.estimated_tokens:,} tokens and the tenant's batches already queued "
        f"{queued:,}; its quota is {quota:,} tokens queued at once. Try again once some "
        "in_progress batches have completed, or ask the operator for a larger quota."
    )


def _text_length(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        if all(isinstance(item, int) for item in value):
            return len(value) * CHARS_PER_TOKEN  # token ids: one token each
        return sum(_text_length(item) for item in value)
    if isinstance(value, dict):  # a message, a content part, a tool: its texts
        return sum(_text_length(item) for item in value.values())
    if value is None or isinstance(value, bool | int | float):
        return 0
    return len(orjson.dumps(value))


@dataclass
class Estimate:
    """A batch's tokens as its quota counts them, summed line by line: what is known from the
    lines, and the sequences that set no bound on their answer (each counted at the model's
    context once the model is known)."""

    tokens: int = 0
    unbounded: int = 0

    def add(self, body: dict[str, Any]) -> None:
        """A line's prompt (the texts of its messages, roles included, tools and prompt, or an
        embeddings line's inputs; four characters a token) and what it may generate (nothing,
        for embeddings): every sequence it runs (prompts x
        ``max(n, best_of)``) times ``max_completion_tokens`` or ``max_tokens``."""
        if "input" in body and "messages" not in body and "prompt" not in body:
            # An embeddings line: its inputs, and nothing generated.
            self.tokens += -(-_text_length(body["input"]) // CHARS_PER_TOKEN)
            return
        prompt = sum(_text_length(body.get(name)) for name in ("messages", "prompt", "tools"))
        self.tokens += -(-prompt // CHARS_PER_TOKEN)
        prompts = body.get("prompt")
        many = isinstance(prompts, list) and prompts and not isinstance(prompts[0], int)
        n = max(_whole(body.get("n")), _whole(body.get("best_of")), 1)
        sequences = (len(prompts) if many and isinstance(prompts, list) else 1) * n
        most = _whole(body.get("max_completion_tokens")) or _whole(body.get("max_tokens"))
        if most:
            self.tokens += most * sequences
        else:
            self.unbounded += sequences

    def total(self, context_length: int) -> int:
        return self.tokens + self.unbounded * context_length


def _whole(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def estimated_tokens(body: dict[str, Any], *, context_length: int = 0) -> int:
    """One line's estimate (``Estimate``)."""
    estimate = Estimate()
    estimate.add(body)
    return estimate.total(context_length)
