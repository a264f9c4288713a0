"""A batch's life: created (parameters checked at once), validated (its file, line by line),
run (``batches.runner``), finalized into its output and error files; cancelled or expired on
the way. Every status change goes through here, under the batch's row lock."""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import tempfile
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

import orjson
from django.conf import settings
from django.core.files.storage import default_storage
from django.db import IntegrityError, transaction
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Sum, TextField
from django.db.models.functions import Cast
from django.utils import timezone

from batches import quotas
from batches.files import file_delete, file_get, file_store_output
from batches.models import Batch, File, Line, epoch
from inference.api.errors import ApiError, invalid_request
from inference.catalog import catalog_read
from tenants.models import ApiKey, Tenant

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions"}
WINDOW = timedelta(hours=24)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_ERRORS_SHOWN = 100  # OpenAI lists the first errors, not thousands of them
INSERT_CHUNK = 1000  # lines inserted at once at most
INSERT_BYTES = 2 * 1024 * 1024  # and at most this many bytes of them (parsed, ~25x that)


# --- reads -----------------------------------------------------------------------------------


def batch_get(*, tenant: Tenant, batch_id: str) -> Batch:
    """Another tenant's batch is as unknown as one that does not exist (404)."""
    found = Batch.objects.filter(tenant=tenant, pk=batch_id).first()
    if found is None:
        raise ApiError(404, f"No such batch: {batch_id}", code="batch_not_found", param="batch_id")
    return found


def batch_list(*, tenant: Tenant) -> QuerySet[Batch]:
    return Batch.objects.filter(tenant=tenant).order_by("-created_at", "-pk")


def _counts(batch: Batch) -> dict[str, int]:
    states = dict(
        Line.objects.filter(batch=batch).values_list("state").annotate(n=Count("pk")).order_by()
    )
    done = states.get(Line.State.DONE, 0)
    failed = sum(
        states.get(s, 0) for s in (Line.State.FAILED, Line.State.CANCELLED, Line.State.EXPIRED)
    )
    return {"total": sum(states.values()), "completed": done, "failed": failed}


def _usage(batch: Batch) -> dict[str, Any]:
    sums = Line.objects.filter(
        batch=batch, state__in=(Line.State.DONE, Line.State.FAILED)
    ).aggregate(
        prompt=Sum("prompt_tokens", default=0),
        completion=Sum("completion_tokens", default=0),
        cached=Sum("cached_tokens", default=0),
    )
    return {
        "input_tokens": sums["prompt"],
        "input_tokens_details": {"cached_tokens": sums["cached"]},
        "output_tokens": sums["completion"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": sums["prompt"] + sums["completion"],
    }


def batch_object(batch: Batch) -> dict[str, Any]:
    """The batch in OpenAI's shape, with live counts and usage (a field without a value is
    left out, as OpenAI's schema has it: the SDKs read it as None)."""
    shaped = {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": epoch(batch.created_at),
        "in_progress_at": epoch(batch.in_progress_at),
        "expires_at": epoch(batch.expires_at),
        "finalizing_at": epoch(batch.finalizing_at),
        "completed_at": epoch(batch.completed_at),
        "failed_at": epoch(batch.failed_at),
        "expired_at": epoch(batch.expired_at),
        "cancelling_at": epoch(batch.cancelling_at),
        "cancelled_at": epoch(batch.cancelled_at),
        "request_counts": batch.kept["request_counts"] if batch.kept else _counts(batch),
        "usage": batch.kept["usage"] if batch.kept else _usage(batch),
        "metadata": batch.metadata,
    }
    return {name: value for name, value in shaped.items() if value is not None}


# --- create ----------------------------------------------------------------------------------


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise invalid_request("`metadata` must be an object.", param="metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid_request(
            f"`metadata` has at most {MAX_METADATA_PAIRS} pairs.", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid_request(
                f"A `metadata` key is at most {MAX_METADATA_KEY} characters.", param="metadata"
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise invalid_request(
                f"A `metadata` value is a string of at most {MAX_METADATA_VALUE} characters.",
                param="metadata",
            )
        if "\x00" in key or "\x00" in value:
            raise invalid_request("`metadata` may not contain NUL characters.", param="metadata")
    return dict(metadata)


def batch_create(
    *, api_key: ApiKey, params: Mapping[str, Any], idempotency_key: str | None = None
) -> tuple[Batch, bool]:
    """Check the parameters (a 400 at once), then queue the file's validation. With an
    ``Idempotency-Key`` the same request again returns the batch it created (False: not
    new); the key with other parameters is a 409."""
    tenant = api_key.tenant
    input_file_id = params.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise invalid_request("`input_file_id` is required.", param="input_file_id")
    endpoint = params.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise invalid_request(
            f"Invalid endpoint `{endpoint}`: batches run {', '.join(sorted(ENDPOINTS))}.",
            param="endpoint",
            code="invalid_endpoint",
        )
    if params.get("completion_window") != "24h":
        raise invalid_request(
            "Invalid `completion_window`: only `24h` is supported.", param="completion_window"
        )
    metadata = _check_metadata(params.get("metadata"))
    if idempotency_key is not None and (len(idempotency_key) > 255 or "\x00" in idempotency_key):
        raise invalid_request("An Idempotency-Key is at most 255 characters.")
    fingerprint = hashlib.sha256(
        orjson.dumps([input_file_id, endpoint, metadata], option=orjson.OPT_SORT_KEYS)
    ).hexdigest()
    if idempotency_key:
        seen = Batch.objects.filter(tenant=tenant, idempotency_key=idempotency_key).first()
        if seen is not None:
            return _replayed(seen, fingerprint), False
    source = file_get(tenant=tenant, file_id=input_file_id)
    if source.purpose != File.Purpose.BATCH:
        raise invalid_request(
            f"File {input_file_id} has purpose `{source.purpose}`, not `batch`.",
            param="input_file_id",
            code="invalid_purpose",
        )
    now = timezone.now()
    batch = Batch(
        tenant=tenant,
        api_key=api_key,
        input_file_id=input_file_id,
        endpoint=endpoint,
        metadata=metadata,
        idempotency_key=idempotency_key or "",
        request_fingerprint=fingerprint,
        expires_at=now + WINDOW,
    )
    try:
        with transaction.atomic():
            locked = quotas.tenant_locked(tenant.pk)
            if idempotency_key:  # a concurrent retry made it while we waited for the lock
                seen = Batch.objects.filter(tenant=tenant, idempotency_key=idempotency_key).first()
                if seen is not None:
                    return _replayed(seen, fingerprint), False
            quotas.open_batches_check(locked)
            batch.save(force_insert=True)
            pk = batch.pk
            transaction.on_commit(lambda: _wake(pk, validate=True))
    except IntegrityError:  # the same key, created by a concurrent retry
        seen = Batch.objects.get(tenant=tenant, idempotency_key=idempotency_key)
        return _replayed(seen, fingerprint), False
    return batch, True


def _replayed(seen: Batch, fingerprint: str) -> Batch:
    if seen.request_fingerprint != fingerprint:
        raise ApiError(
            409,
            "This Idempotency-Key was used for another batch request.",
            code="idempotency_key_reused",
        )
    return seen


# --- validate --------------------------------------------------------------------------------


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


def free(hold: str, now: datetime) -> Q:
    """Batches nobody holds: ``hold`` (``validating_until``, ``running_until``) unset or past."""
    return Q(**{f"{hold}__isnull": True}) | Q(**{f"{hold}__lt": now})


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
        callable_now = catalog_read(tenant_id=batch.tenant_id).callable(
            model, batch.tenant_id, kind="batch"
        )
        if callable_now is None:
            errors.add(
                "model_not_found",
                f"The model `{_shown(model)}` does not exist or you do not have access to it.",
                line=None,
                param="body.model",
            )
        elif callable_now.pool is None:
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
            return _settle_cancelled(locked)
        if locked.status != Batch.Status.VALIDATING:
            return locked
        locked.status = Batch.Status.IN_PROGRESS
        locked.in_progress_at = timezone.now()
        locked.model = model
        locked.save(update_fields=["status", "in_progress_at", "model", "estimated_tokens"])
        pk = locked.pk
        transaction.on_commit(lambda: _wake(pk))
    return locked


def _wake(batch_id: str, *, validate: bool = False) -> None:
    """Queue the batch's validation or a run; if the broker cannot take it now, the sweeper
    will (the change that asked for it is committed either way)."""
    from batches.tasks import batch_run_task, batch_validate_task

    try:
        (batch_validate_task if validate else batch_run_task).delay(batch_id)
    except Exception:
        log.warning("could not queue work for %s: the sweeper will", batch_id, exc_info=True)


def _fail(batch: Batch, errors: _Errors, *, model: str = "") -> Batch:
    """The file is bad: the batch fails, unless it was cancelled meanwhile (then it is)."""
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch.pk)
        if locked.status == Batch.Status.CANCELLING and locked.ending_at is None:
            Line.objects.filter(batch=locked).delete()
            return _settle_cancelled(locked)
        if locked.status != Batch.Status.VALIDATING:
            return locked
        locked.status = Batch.Status.FAILED
        locked.failed_at = timezone.now()
        locked.errors = errors.data
        locked.model = model[:200]
        locked.save(update_fields=["status", "failed_at", "errors", "model"])
    return locked


# --- cancel, expire, finalize ----------------------------------------------------------------


def batch_cancel(*, batch: Batch) -> Batch:
    """Unstarted lines are cancelled; lines running finish and keep their results; then the
    batch is finalized as ``cancelled``. A repeated cancel changes nothing; a batch that
    finished otherwise (completed, failed, expired) cannot be cancelled (409)."""
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch.pk)
        if locked.cancelling_at is not None:  # cancelled already (or being): nothing changes
            return locked
        if locked.status in Batch.FINISHED or locked.ending_at is not None:
            raise ApiError(
                409,
                f"Cannot cancel a batch with status `{locked.status}`.",
                code="batch_not_cancellable",
            )
        locked.status = Batch.Status.CANCELLING
        locked.cancelling_at = timezone.now()
        locked.save(update_fields=["status", "cancelling_at"])
        Line.objects.filter(batch=locked, state=Line.State.PENDING).update(
            state=Line.State.CANCELLED, response=error_body("batch_cancelled")
        )
        pk = locked.pk
        transaction.on_commit(lambda: _wake(pk))
    return locked


def error_body(code: str) -> dict[str, Any]:
    messages = {
        "batch_cancelled": "The batch was cancelled before this request ran.",
        "batch_expired": "The batch expired before this request completed.",
    }
    return {"code": code, "message": messages[code]}


def batches_expire() -> int:
    """Batches past their window: what has not finished expires (never billed); their files
    are written by the batch worker (``batch_finalize_task``)."""
    expired = 0
    due = Batch.objects.filter(
        expires_at__lt=timezone.now(),
        status__in=(Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING),
        ending_at__isnull=True,
    ).values_list("pk", flat=True)
    for pk in due:
        with transaction.atomic():
            locked = Batch.objects.select_for_update().get(pk=pk)
            if locked.status in Batch.FINISHED or locked.ending_at is not None:
                continue
            Line.objects.filter(
                batch=locked, state__in=(Line.State.PENDING, Line.State.RUNNING)
            ).update(state=Line.State.EXPIRED, owner="", response=error_body("batch_expired"))
            _begin_ending(locked, Batch.Status.EXPIRED, writer=False)
            transaction.on_commit(functools.partial(_finalize_later, locked.pk))
        expired += 1
    return expired


def _finalize_later(batch_id: str) -> None:
    from batches.tasks import batch_finalize_task

    try:
        batch_finalize_task.delay(batch_id)
    except Exception:
        log.warning("could not queue the files of %s: the sweeper will", batch_id, exc_info=True)


def batch_finish_if_done(*, batch_id: str) -> bool:
    """When no line is left to run: finalize (write the files). True once finished."""
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch_id)
        if locked.status in Batch.FINISHED:
            return True
        if locked.ending_at is not None or locked.status not in (
            Batch.Status.IN_PROGRESS,
            Batch.Status.CANCELLING,
        ):
            return False
        now = timezone.now()
        if locked.in_progress_at is None and (
            locked.validating_until is not None and locked.validating_until > now
        ):
            return False  # cancelled while validating: the validator settles it
        if locked.status == Batch.Status.CANCELLING:
            # A line put back after the cancel, or one whose worker died: it will not run.
            dead = Q(state=Line.State.RUNNING, lease_until__lt=now)
            Line.objects.filter(batch=locked).filter(Q(state=Line.State.PENDING) | dead).update(
                state=Line.State.CANCELLED, owner="", response=error_body("batch_cancelled")
            )
        if Line.objects.filter(
            batch=locked, state__in=(Line.State.PENDING, Line.State.RUNNING)
        ).exists():
            return False
        final = (
            Batch.Status.CANCELLED
            if locked.status == Batch.Status.CANCELLING
            else Batch.Status.COMPLETED
        )
        stamp = _begin_ending(locked, final)
    _write_files(locked, final=final, stamp=stamp)
    return True


def _begin_ending(locked: Batch, final: str, *, writer: bool = True) -> datetime:
    """Under the batch's row lock: its files are being written from now on, by whoever holds
    this stamp. A batch about to complete shows ``finalizing`` meanwhile; one being
    cancelled or expired keeps its status until it is ``cancelled`` or ``expired``, as
    OpenAI's do. Without a ``writer`` (an expiry: the batch worker writes), the stamp is
    one nobody holds: the first ``batch_finalize`` takes it, and the next only once that
    writer's stamp is as old as a lease (it died)."""
    now = timezone.now()
    stamp = now if writer else now - timedelta(seconds=settings.INFERPLANE_BATCH_LEASE_SECONDS + 1)
    locked.ending_at, locked.ending_as = stamp, final
    fields = ["ending_at", "ending_as"]
    if final == Batch.Status.COMPLETED:
        locked.status = Batch.Status.FINALIZING
        locked.finalizing_at = now
        fields += ["status", "finalizing_at"]
    locked.save(update_fields=fields)
    return stamp


def _settle_cancelled(batch: Batch) -> Batch:
    stamp = _begin_ending(batch, Batch.Status.CANCELLED)
    pk = batch.pk
    transaction.on_commit(lambda: _write_files_of(pk, stamp))
    return batch


def _write_files_of(batch_id: str, stamp: datetime) -> None:
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    _write_files(batch, final=batch.ending_as, stamp=stamp)


def batch_finalize(*, batch_id: str) -> None:
    """Write the files of a batch whose ending began (expired), or take over the writing
    from a worker that began it and died (its stamp older than a lease)."""
    now = timezone.now()
    stale = now - timedelta(seconds=settings.INFERPLANE_BATCH_LEASE_SECONDS)
    with transaction.atomic():
        locked = Batch.objects.select_for_update().select_related("tenant").get(pk=batch_id)
        if locked.status in Batch.FINISHED or locked.ending_at is None:
            return
        if locked.ending_at > stale:
            return  # its writer may still be at it (an expired batch's first is not yet)
        locked.ending_at = now  # the writing is ours now: the other writer's result is void
        locked.save(update_fields=["ending_at"])
    _write_files(locked, final=locked.ending_as or Batch.Status.COMPLETED, stamp=now)


def output_line(line: Line, response: str | None) -> bytes:
    """One line of an output or error file, in OpenAI's shape; ``response``: the line's
    stored response as JSON text (put in as it is: an answer is never parsed here)."""
    if line.state in (Line.State.DONE, Line.State.FAILED):
        item: dict[str, Any] = {
            "id": line.result_id,
            "custom_id": line.custom_id,
            "response": {
                "status_code": line.status_code,
                "request_id": line.request_id,
                "body": _RESPONSE,
            },
            "error": None,
        }
    else:  # cancelled or expired: never answered
        item = {
            "id": line.result_id or "batch_req_" + secrets.token_hex(12),
            "custom_id": line.custom_id,
            "response": None,
            "error": _RESPONSE,
        }
    head, _, tail = orjson.dumps(item).partition(_RESPONSE_JSON)
    return head + (response or "null").encode() + tail + b"\n"


# Where a line's stored response goes in its output line: a string with a NUL, which no
# custom_id has (the validator refuses NUL) and nothing of ours does.
_RESPONSE = "\x00response"
_RESPONSE_JSON = orjson.dumps(_RESPONSE)


def _write_files(batch: Batch, *, final: str, stamp: datetime) -> None:
    """The output file (answered lines, in input order) and the error file (the others),
    written line by line from the database to temporary files, then to storage. Only the
    holder of the ending's ``stamp`` links its files to the batch; a writer that lost its
    stamp (another took over) removes its own, and the winner removes earlier attempts'."""
    names = (f"{batch.id}_output.jsonl", f"{batch.id}_error.jsonl")
    counts = {"output": 0, "error": 0}
    with tempfile.TemporaryFile() as output, tempfile.TemporaryFile() as error:
        # Neither the request nor the answer is parsed: a line's answer goes into its output
        # line as the JSON text the database gives (parsed, it would hold ~10x its size).
        lines = (
            Line.objects.filter(batch=batch)
            .defer("body", "response")
            .annotate(response_text=Cast("response", TextField()))
            .order_by("number")
            .iterator(chunk_size=100)
        )
        for line in lines:
            target = "output" if line.state == Line.State.DONE else "error"
            text = line.response_text
            (output if target == "output" else error).write(output_line(line, text))
            counts[target] += 1
        made: list[File] = []
        for target, content, name in (("output", output, names[0]), ("error", error, names[1])):
            if counts[target]:
                made.append(
                    file_store_output(
                        tenant=batch.tenant, name=name, content=content, lines=counts[target]
                    )
                )
    output_id = next((f.id for f in made if f.filename == names[0]), "")
    error_id = next((f.id for f in made if f.filename == names[1]), "")
    stamp_field = {
        Batch.Status.COMPLETED: "completed_at",
        Batch.Status.CANCELLED: "cancelled_at",
        Batch.Status.EXPIRED: "expired_at",
    }[Batch.Status(final)]
    linked = (
        Batch.objects.filter(pk=batch.pk, ending_at=stamp)
        .exclude(status__in=Batch.FINISHED)
        .update(
            status=final,
            output_file_id=output_id,
            error_file_id=error_id,
            **{stamp_field: timezone.now()},
        )
    )
    mine = {f.id for f in made}
    if not linked:
        for file in made:
            file_delete(file=file)
        return
    for earlier in File.objects.filter(tenant=batch.tenant, filename__in=names).exclude(
        pk__in=mine
    ):
        file_delete(file=earlier)


PURGE_AT_ONCE = 100  # batches per sweep: a sweep stays short, the next one goes on


def batches_purge() -> int:
    """The lines of batches finished more than the retention period ago are deleted (their
    bodies and answers are the tenant's data); the batch keeps its counts and usage."""
    before = timezone.now() - timedelta(days=settings.INFERPLANE_RETENTION_DAYS)
    old = Batch.objects.filter(status__in=Batch.FINISHED, kept__isnull=True).filter(
        Q(completed_at__lt=before)
        | Q(failed_at__lt=before)
        | Q(expired_at__lt=before)
        | Q(cancelled_at__lt=before)
    )
    purged = 0
    for batch in old.only("pk")[:PURGE_AT_ONCE]:
        with transaction.atomic():
            locked = Batch.objects.select_for_update().get(pk=batch.pk)
            if locked.kept is not None:  # another sweep did it meanwhile
                continue
            locked.kept = {"request_counts": _counts(locked), "usage": _usage(locked)}
            locked.save(update_fields=["kept"])
            Line.objects.filter(batch=locked).delete()
        purged += 1
    return purged


def batches_runnable(now: datetime) -> QuerySet[Batch]:
    """Running batches with work nobody is doing (no run holds them): lines ready to run
    and none on a live lease, lines whose lease ran out (their worker died), or nothing left
    to run and no ending begun (the last worker died before finalizing)."""
    lines = Line.objects.filter(batch=OuterRef("pk"))
    ready = lines.filter(state=Line.State.PENDING).filter(
        Q(lease_until__isnull=True) | Q(lease_until__lt=now)
    )
    live = lines.filter(state=Line.State.RUNNING, lease_until__gte=now)
    dead = lines.filter(state=Line.State.RUNNING, lease_until__lt=now)
    unfinished = lines.filter(state__in=(Line.State.PENDING, Line.State.RUNNING))
    return (
        Batch.objects.filter(
            status__in=(Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING),
            ending_at__isnull=True,
        )
        .filter(free("running_until", now))
        .filter(
            (Exists(ready) & ~Exists(live))
            | Exists(dead)
            | (~Exists(unfinished) & Q(in_progress_at__isnull=False))
        )
    )


def batches_stuck() -> list[str]:
    """Batches with work nobody is doing: running ones (``batches_runnable``), validating
    ones whose validator's lease ran out (or that never got one), ending ones whose writer's
    stamp is old. The sweeper wakes a worker for each."""
    now = timezone.now()
    stale = now - timedelta(seconds=settings.INFERPLANE_BATCH_LEASE_SECONDS)
    running = batches_runnable(now)
    validating = Batch.objects.filter(
        status__in=(Batch.Status.VALIDATING, Batch.Status.CANCELLING), in_progress_at__isnull=True
    ).filter(
        Q(validating_until__lt=now)
        | Q(validating_until__isnull=True, created_at__lt=now - timedelta(seconds=30))
    )
    ending = (
        Batch.objects.filter(ending_at__isnull=False)
        .exclude(status__in=Batch.FINISHED)
        .filter(ending_at__lt=stale)
    )
    ids = set(running.values_list("pk", flat=True))
    ids |= set(validating.exclude(ending_at__isnull=False).values_list("pk", flat=True))
    ids |= set(ending.values_list("pk", flat=True))
    return sorted(ids)
