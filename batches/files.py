"""Files: a tenant's uploads (``purpose=batch``) and its batches' results (``batch_output``),
in the default storage (the filesystem under ``var/media``, or S3 as adapters are).

An upload reaches us already spooled to a temporary file by Django (past 2.5 MB), is read
once, line by line, to check it and count its lines, and is streamed to storage: nothing
holds a whole file in memory, whatever its size.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import IO, Any

from django.conf import settings
from django.core.files import File as DjangoFile
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from django.utils import timezone
from django.utils.http import content_disposition_header

from batches import quotas
from batches.models import File
from inference.gateway.errors import ApiError, invalid_request
from tenants.models import Tenant

PURPOSES_UPLOADED = {File.Purpose.BATCH}


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", code="file_not_found", param="file_id")


def file_get(*, tenant: Tenant, file_id: str) -> File:
    """Another tenant's file is as unknown as one that does not exist (404)."""
    found = File.objects.filter(tenant=tenant, pk=file_id).first()
    if found is None:
        raise _not_found(file_id)
    return found


def file_list(*, tenant: Tenant, purpose: str | None = None) -> QuerySet[File]:
    files = File.objects.filter(tenant=tenant)
    if purpose:
        files = files.filter(purpose=purpose)
    return files


def count_lines(upload: IO[bytes], *, max_lines: int) -> int:
    """The JSONL lines of an upload (blank lines not counted), read in chunks."""
    lines = 0
    tail = b""
    for chunk in iter(lambda: upload.read(1 << 20), b""):
        parts = (tail + chunk).split(b"\n")
        tail = parts.pop()
        lines += sum(1 for part in parts if part.strip())
        if lines > max_lines:
            break
    if tail.strip():
        lines += 1
    if lines > max_lines:
        raise invalid_request(
            f"The file has more than {max_lines:,} lines; a batch takes at most {max_lines:,} "
            "requests. Split it into several files.",
            param="file",
            code="too_many_lines",
        )
    return lines


def file_upload(
    *,
    tenant: Tenant,
    upload: DjangoFile[Any],
    purpose: str,
    expires_after_seconds: int | None = None,
) -> File:
    """Store an upload for ``purpose`` (only ``batch`` can be uploaded)."""
    if purpose not in PURPOSES_UPLOADED:
        raise invalid_request(
            f"Invalid purpose `{purpose}`: files uploaded here are for `batch`.",
            param="purpose",
            code="invalid_purpose",
        )
    name = (upload.name or "").rsplit("/", 1)[-1]
    if not name.endswith(".jsonl"):
        raise invalid_request(
            "A batch input file must be JSONL, with a `.jsonl` name.",
            param="file",
            code="invalid_file_format",
        )
    size = upload.size or 0
    if size > settings.INFERPLANE_FILE_MAX_BYTES:
        raise invalid_request(
            f"The file is {size:,} bytes; files are at most "
            f"{settings.INFERPLANE_FILE_MAX_BYTES:,} bytes.",
            param="file",
            code="file_too_large",
        )
    upload.seek(0)
    lines = count_lines(upload, max_lines=settings.INFERPLANE_BATCH_MAX_LINES)
    if lines == 0:
        raise invalid_request("The file is empty.", param="file", code="empty_file")
    # Before a byte is stored (the tenant read afresh: a key's may be cached), and again
    # under the tenant's lock once it is.
    quotas.storage_check(Tenant.objects.get(pk=tenant.pk), size)
    upload.seek(0)
    row = File(tenant=tenant, purpose=purpose, filename=name[:255], bytes=size, lines=lines)
    row.expires_at = _expiry(expires_after_seconds)
    row.path = default_storage.save(f"files/{tenant.pk}/{row.id}.jsonl", upload)
    try:
        with transaction.atomic():
            quotas.storage_check(quotas.tenant_locked(tenant.pk), size)
            row.save(force_insert=True)
    except BaseException:
        default_storage.delete(row.path)
        raise
    return row


def _expiry(after_seconds: int | None = None) -> datetime:
    """When a file is deleted: when its uploader asked, at the latest after the retention
    period (``INFERPLANE_RETENTION_DAYS``)."""
    retention = timedelta(days=settings.INFERPLANE_RETENTION_DAYS)
    asked = timedelta(seconds=after_seconds) if after_seconds is not None else retention
    return timezone.now() + min(asked, retention)


def file_store_output(*, tenant: Tenant, name: str, content: IO[bytes], lines: int) -> File:
    """A batch's output or error file, from a local temporary file (streamed to storage)."""
    size = content.seek(0, 2)
    content.seek(0)
    row = File(
        tenant=tenant,
        purpose=File.Purpose.BATCH_OUTPUT,
        filename=name,
        bytes=size,
        lines=lines,
        expires_at=_expiry(),
    )
    row.path = default_storage.save(f"files/{tenant.pk}/{row.id}.jsonl", DjangoFile(content))
    row.save(force_insert=True)
    return row


CHUNK_BYTES = 1 << 16


async def file_chunks(*, file: File) -> AsyncIterator[bytes]:
    """The file's bytes, one 64 KiB chunk at a time, each read in a worker thread (the
    storage may be S3). Served over ASGI, a download holds one chunk in the web process
    whatever the file's size: Django reads a *synchronous* iterator whole into memory before
    it sends a byte (four downloads of a 150 MB file took two web processes from 470 MB to
    1,063 MB, never given back)."""
    stream = await asyncio.to_thread(default_storage.open, file.path, "rb")
    try:
        while chunk := await asyncio.to_thread(stream.read, CHUNK_BYTES):
            yield chunk
    finally:
        await asyncio.to_thread(stream.close)


def file_download(*, file: File) -> StreamingHttpResponse:
    """The file as the Files API's ``/content`` gives it (and the dashboard's link)."""
    response = StreamingHttpResponse(file_chunks(file=file), content_type="application/jsonl")
    response["Content-Length"] = str(file.bytes)
    # The name is the uploader's: quoted and encoded (RFC 6266), never pasted in.
    response["Content-Disposition"] = content_disposition_header(True, file.filename)
    return response


@transaction.atomic
def file_delete(*, file: File) -> None:
    File.objects.filter(pk=file.pk).delete()
    path = file.path
    transaction.on_commit(lambda: default_storage.delete(path))


def files_expired_delete() -> int:
    """Files past their ``expires_at`` are deleted (Celery beat)."""
    gone = 0
    for file in File.objects.filter(expires_at__lt=timezone.now()).iterator():
        file_delete(file=file)
        gone += 1
    return gone
