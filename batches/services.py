"""A batch's changes of state: created (parameters checked at once), cancelled, expired,
finished, its files' writing begun and taken over, purged. Each under the batch's row lock;
validation is ``batches.validation``, the run ``batches.runner``, reads
``batches.selectors``, OpenAI's shapes ``batches.wire``."""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import orjson
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from batches import quotas
from batches.files import file_get
from batches.models import Batch, File, Line
from batches.results import write_files, write_files_of
from batches.selectors import batch_line_counts, batch_usage
from batches.signals import batch_files_waiting, batch_work_waiting
from batches.wire import ENDPOINTS, error_body
from inference.gateway.errors import ApiError, invalid_request
from tenants.models import ApiKey

log = logging.getLogger(__name__)


WINDOW = timedelta(hours=24)


MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


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
            transaction.on_commit(lambda: batch_wake(pk, validate=True))
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


def batch_wake(batch_id: str, *, validate: bool = False) -> None:
    """Ask for the batch's validation or a run (``batches.tasks`` queues it; run it from
    ``transaction.on_commit``)."""
    batch_work_waiting.send(sender=Batch, batch_id=batch_id, validate=validate)


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
        transaction.on_commit(lambda: batch_wake(pk))
    return locked


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
    batch_files_waiting.send(sender=Batch, batch_id=batch_id)


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
    write_files(locked, final=final, stamp=stamp)
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


def batch_settle_cancelled(batch: Batch) -> Batch:
    stamp = _begin_ending(batch, Batch.Status.CANCELLED)
    pk = batch.pk
    transaction.on_commit(lambda: write_files_of(pk, stamp))
    return batch


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
    write_files(locked, final=locked.ending_as or Batch.Status.COMPLETED, stamp=now)


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
            locked.kept = {
                "request_counts": batch_line_counts(locked),
                "usage": batch_usage(locked),
            }
            locked.save(update_fields=["kept"])
            Line.objects.filter(batch=locked).delete()
        purged += 1
    return purged
