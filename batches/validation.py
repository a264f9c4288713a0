"""A batch's input file, read once, line by line, by one validator at a time (a lease on the
batch): a file with any bad line fails the batch with each problem and its line number; a
good one becomes lines to run, inserted a bounded number of bytes at a time."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

import orjson
from django.conf import settings
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone

from batches import quotas
from batches.models import Batch, File, Line
from batches.selectors import free
from batches.services import batch_settle_cancelled, batch_wake
from batches.wire import error_body
from inference.catalog import catalog_read

log = logging.getLogger(__name__)

MAX_ERRORS_SHOWN = 100  # OpenAI lists the first errors, not thousands of them


INSERT_CHUNK = 1000  # lines inserted at once at most


INSERT_BYTES = 2 * 1024 * 1024  # and at most this many bytes of them (parsed, ~25x that)


class _Errors:
    def __init__(self) -> None:
        self.data: list[dict[str, Any]] = []
        self.count = 0

    def add(self, code: str, message: str, *, line: int | None, param: str | None = None) -> None:
        self.count += 1
        if len(self.data) < MAX_ERRORS_SHOWN:
            self.data.append({"code": code, "message": message, "param": param, "line": line})


def _shown(value: Any, most: int = 80) -> str:
    """A user's value in a message, cut short (it may be up to a line's size)."""
    text = str(value)
    return text if len(text) <= most else text[:most] + "…"


def _lines(path: str, errors: _Errors) -> Iterable[tuple[int, bytes]]:
    """The non-blank lines of a stored file, each read up to the line limit (a longer one
    is noted as an error and skipped, never held whole)."""
    limit = settings.INFERPLANE_BATCH_MAX_LINE_BYTES
    with default_storage.open(path, "rb") as stream:
        number = 0
        while True:
            raw = stream.readline(limit + 1)
            if not raw:
                return
            number += 1
            if len(raw) > limit and not raw.endswith(b"\n"):
                size = len(raw)
                while raw and not raw.endswith(b"\n"):  # the rest of the line, unkept
                    raw = stream.readline(1 << 20)
                    size += len(raw)
                errors.add(
                    "line_too_large",
                    f"The line is {size:,} bytes or more; a line is at most {limit:,}.",
                    line=number,
                )
                continue
            if raw.strip():
                yield number, raw


def _check_line(
    raw: bytes, number: int, batch: Batch, errors: _Errors, seen: set[str], models: set[str]
) -> tuple[str, dict[str, Any]] | None:
    if b"\\u0000" in raw.lower() or b"\x00" in raw:
        errors.add(
            "invalid_json_line", "A line may not contain NUL characters (\\u0000).", line=number
        )
        return None
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        errors.add("invalid_json_line", "This line is not valid JSON.", line=number)
        return None
    if not isinstance(item, dict):
        errors.add("invalid_json_line", "A line is a JSON object.", line=number)
        return None
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        errors.add(
            "missing_required_parameter",
            "A line needs a `custom_id`: a string of at most 512 characters.",
            line=number,
            param="custom_id",
        )
        return None
    if custom_id in seen:
        errors.add(
            "duplicate_custom_id",
            f"The custom_id `{_shown(custom_id)}` is used by an earlier line.",
            line=number,
            param="custom_id",
        )
        return None
    seen.add(custom_id)
    if item.get("method") != "POST":
        errors.add(
            "invalid_method", "A line's `method` must be `POST`.", line=number, param="method"
        )
        return None
    if item.get("url") != batch.endpoint:
        errors.add(
            "url_mismatch",
            f"The line's url `{_shown(item.get('url'))}` is not the batch's endpoint "
            f"`{batch.endpoint}`.",
            line=number,
            param="url",
        )
        return None
    body = item.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        errors.add(
            "invalid_request",
            "A line's `body` is the request, an object naming its `model`.",
            line=number,
            param="body",
        )
        return None
    if body.get("stream"):
        errors.add(
            "invalid_request",
            "Streaming is not available in a batch: leave `stream` out.",
            line=number,
            param="body.stream",
        )
        return None
    if len(body["model"]) > 200:
        errors.add(
            "invalid_request",
            "A `model` name is at most 200 characters.",
            line=number,
            param="body.model",
        )
        return None
    models.add(body["model"])
    return custom_id, body


def validation_take(batch_id: str) -> datetime | None:
    """Hold the batch's validation (a lease on the batch): the lease, or None when it is
    not validating or another validator holds it."""
    now = timezone.now()
    lease = now + timedelta(seconds=settings.INFERPLANE_BATCH_LEASE_SECONDS)
    held = (
        Batch.objects.filter(free("validating_until", now), pk=batch_id)
        .filter(status=Batch.Status.VALIDATING)
        .update(validating_until=lease)
    )
    return lease if held else None


def batch_validate(*, batch_id: str, lease: datetime | None = None) -> Batch:
    """Read the input file once, line by line: a file with any bad line fails the batch with
    each problem and its line number; a good one becomes lines to run. One validator at a
    time (a lease on the batch: a redelivered or swept task finds it held and leaves);
    ``lease``: the one ``validation_take`` gave this caller already."""
    lease = lease or validation_take(batch_id)
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    if lease is None:
        return batch
    errors = _Errors()
    source = File.objects.filter(tenant=batch.tenant, pk=batch.input_file_id).first()
    seen: set[str] = set()
    models: set[str] = set()
    if source is None:
        errors.add("file_not_found", "The input file was deleted.", line=None)
        return _fail(batch, errors)
    Line.objects.filter(batch=batch).delete()  # a validation interrupted half-way
    pending: list[Line] = []
    pending_bytes = 0  # of the lines in ``pending``: parsed, they hold up to ~25 times that
    total = 0
    estimated = quotas.Estimate()
    for number, raw in _lines(source.path, errors):
        total += 1
        if total > settings.INFERPLANE_BATCH_MAX_LINES:
            errors.add(
                "too_many_tasks",
                f"A batch has at most {settings.INFERPLANE_BATCH_MAX_LINES:,} requests.",
                line=number,
            )
            break
        checked = _check_line(raw, number, batch, errors, seen, models)
        if checked is None or errors.count:
            continue
        estimated.add(checked[1])
        pending.append(
            Line(batch=batch, number=number, custom_id=checked[0], body=checked[1], size=len(raw))
        )
        pending_bytes += len(raw)
        if len(pending) >= INSERT_CHUNK or pending_bytes >= INSERT_BYTES:
            Line.objects.bulk_create(pending)
            pending, pending_bytes = [], 0
    if total == 0 and not errors.count:
        errors.add("empty_file", "The input file has no requests.", line=None)
    if len(models) > 1:
        errors.add(
            "model_mismatch",
            "Every line of a batch names the same model; this file names "
            + ", ".join(f"`{_shown(m)}`" for m in sorted(models)[:5])
            + ".",
            line=None,
            param="body.model",
        )
    model = next(iter(models), "")
    context_length = 0
    if model and not errors.count:
        catalog = catalog_read(tenant_id=batch.tenant_id)
        callable_now = catalog.callable(model, batch.tenant_id, kind="batch")
        if callable_now is None:
            errors.add(
                "model_not_found",
                f"The model `{_shown(model)}` does not exist or you do not have access to it.",
                line=None,
                param="body.model",
            )
        elif callable_now.pool is None and catalog.lender(model, batch.tenant_id) is None:
            # A spot pool runs it, or the room its online pool lends.
            errors.add(
                "model_not_found",
                f"No batch pool serves `{_shown(model)}`.",
                line=None,
                param="body.model",
            )
        else:
            context_length = callable_now.model.context_length
    if errors.count:
        Line.objects.filter(batch=batch).delete()
        return _fail(batch, errors, model=model)
    Line.objects.bulk_create(pending)
    with transaction.atomic():
        tenant = quotas.tenant_locked(batch.tenant_id)  # the tenant's queued tokens take turns
        locked = Batch.objects.select_for_update().get(pk=batch.pk)
        if locked.validating_until != lease:  # we were too slow: another validator took over
            return locked
        locked.estimated_tokens = estimated.total(context_length)
        over = quotas.queue_tokens_over(tenant, locked)
        if over is not None and locked.status == Batch.Status.VALIDATING:
            Line.objects.filter(batch=batch).delete()
            errors.add("token_limit_exceeded", over, line=None)
            return _fail(locked, errors, model=model)
        if locked.status == Batch.Status.CANCELLING and locked.ending_at is None:
            Line.objects.filter(batch=batch, state=Line.State.PENDING).update(
                state=Line.State.CANCELLED, response=error_body("batch_cancelled")
            )
            locked.model = model
            locked.save(update_fields=["model"])
            return batch_settle_cancelled(locked)
        if locked.status != Batch.Status.VALIDATING:
            return locked
        locked.status = Batch.Status.IN_PROGRESS
        locked.in_progress_at = timezone.now()
        locked.model = model
        locked.save(update_fields=["status", "in_progress_at", "model", "estimated_tokens"])
        pk = locked.pk
        transaction.on_commit(lambda: batch_wake(pk))
    return locked


def _fail(batch: Batch, errors: _Errors, *, model: str = "") -> Batch:
    """The file is bad: the batch fails, unless it was cancelled meanwhile (then it is)."""
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch.pk)
        if locked.status == Batch.Status.CANCELLING and locked.ending_at is None:
            Line.objects.filter(batch=locked).delete()
            return batch_settle_cancelled(locked)
        if locked.status != Batch.Status.VALIDATING:
            return locked
        locked.status = Batch.Status.FAILED
        locked.failed_at = timezone.now()
        locked.errors = errors.data
        locked.model = model[:200]
        locked.save(update_fields=["status", "failed_at", "errors", "model"])
    return locked
