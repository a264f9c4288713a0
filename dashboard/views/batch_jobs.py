"""A tenant's batches: the list, a batch started from an uploaded file, one batch's lines
and files, cancelling."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
)
from django.http.response import HttpResponseBase
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from batches import files as batch_files
from batches import selectors as batch_selectors
from batches import services as batch_services
from batches import wire as batch_wire
from batches.models import Batch
from dashboard import forms
from dashboard.access import page_access, page_user
from dashboard.views.common import can, page_context
from inference.gateway.errors import ApiError
from tenants import selectors as tenant_selectors
from tenants.access import Perm, TenantAccess
from tenants.models import ApiKey

# --- Batches ---------------------------------------------------------------------------


def _batch_rows(access: TenantAccess) -> dict[str, Any]:
    rows = [
        batch_wire.batch_object(b) for b in batch_selectors.batch_list(tenant=access.tenant)[:100]
    ]
    for row in rows:
        counts = row["request_counts"]
        row["done"] = counts["completed"] + counts["failed"]
        row["created"] = datetime.fromtimestamp(row["created_at"], tz=UTC)
    return {"batches": rows}


@login_required
@require_http_methods(["GET", "POST"])
def batches(request: HttpRequest, slug: str) -> HttpResponse:
    """The tenant's batches (the table refreshes itself), and a batch started from a file
    sent here: stored as the Files API stores it, made as the Batch API makes it, for a key
    the member may use (any of the tenant's with the ``batch`` scope for those who manage
    every key, their own otherwise)."""
    access = page_access(request, slug)
    user = page_user(request)
    keys = tenant_selectors.api_keys_active(
        tenant=access.tenant,
        scope=ApiKey.Scope.BATCH,
        created_by=None if access.can(Perm.KEYS_MANAGE_ANY) else user,
    )
    form = forms.BatchUploadForm(keys=keys)
    status, too_big = 200, ""
    if request.method == "POST":
        if not access.can(Perm.BATCHES_MANAGE):
            raise PermissionDenied("Your role does not allow starting batches.")
        status = 400  # unless the batch is made below
        if int(request.META.get("CONTENT_LENGTH") or 0) > settings.INFERPLANE_FILE_MAX_BYTES:
            status = 413  # refused before the body is read
            too_big = f"Files are limited to {settings.INFERPLANE_FILE_MAX_BYTES:,} bytes."
        else:
            form = forms.BatchUploadForm(request.POST, request.FILES, keys=keys)
            if form.is_valid():
                made = _batch_start(access, form.cleaned_data)
                if isinstance(made, Batch):
                    return redirect("dashboard:batch", slug=slug, batch_id=made.id)
                form.add_error("file" if made.param == "file" else None, made.message)
    context = page_context(
        request,
        access,
        "batches",
        form=form,
        too_big=too_big,
        max_bytes=settings.INFERPLANE_FILE_MAX_BYTES,
        **_batch_rows(access),
    )
    return render(request, "dashboard/batches.html", context, status=status)


def _batch_start(access: TenantAccess, data: dict[str, Any]) -> Batch | ApiError:
    """The file stored, then the batch made: the Batch API's refusal (a quota, a wrong line
    count) if either step refuses, and then the file is not kept."""
    try:
        stored = batch_files.file_upload(tenant=access.tenant, upload=data["file"], purpose="batch")
    except ApiError as error:
        return error
    description = data["description"]
    params = {
        "input_file_id": stored.id,
        "endpoint": data["endpoint"],
        "completion_window": "24h",
        "metadata": {"description": description} if description else None,
    }
    try:
        batch, _ = batch_services.batch_create(api_key=data["api_key"], params=params)
    except ApiError as error:
        batch_files.file_delete(file=stored)
        return error
    return batch


@login_required
@require_GET
def batch_rows(request: HttpRequest, slug: str) -> HttpResponse:
    """The batch table alone: polled every 2 s while the page is open (a batch made with the
    API appears, a running one's lines move)."""
    access = page_access(request, slug)
    context = {"tenant": access.tenant, "can": can(access), **_batch_rows(access)}
    return render(request, "dashboard/_batch_rows.html", context)


@login_required
@require_POST
def batch_cancel(request: HttpRequest, slug: str, batch_id: str) -> HttpResponse:
    access = page_access(request, slug, Perm.BATCHES_MANAGE)
    try:
        batch = batch_selectors.batch_get(tenant=access.tenant, batch_id=batch_id)
        batch_services.batch_cancel(batch=batch)
    except ApiError as error:
        if error.status == 404:
            raise Http404("No such batch.") from None
        context = page_context(
            request, access, "batches", error=error.message, **_batch_rows(access)
        )
        return render(request, "dashboard/batches.html", context, status=error.status)
    return redirect("dashboard:batches", slug=slug)


@login_required
@require_GET
def batch_detail(request: HttpRequest, slug: str, batch_id: str) -> HttpResponse:
    """One batch: its lines by state, the first errors, tokens and cost so far and its files;
    refreshed every 2 s until it is final."""
    access = page_access(request, slug)
    try:
        found = batch_selectors.batch_get(tenant=access.tenant, batch_id=batch_id)
    except ApiError:
        raise Http404("No such batch.") from None
    failed = [
        {
            "number": line.number,
            "custom_id": line.custom_id,
            "status": line.status_code,
            "message": _line_error(line.response),
        }
        for line in batch_selectors.batch_lines_failed(found)
    ]
    context = page_context(
        request,
        access,
        "batches",
        b=batch_wire.batch_object(found),
        states=batch_selectors.batch_lines_by_state(found),
        failed=failed,
        cost=batch_selectors.batch_cost_micros(found) if access.can(Perm.BILLING_VIEW) else None,
        live=found.status not in Batch.FINISHED,
    )
    if request.GET.get("fragment"):
        return render(request, "dashboard/_batch_detail.html", context)
    return render(request, "dashboard/batch.html", context)


def _line_error(response: Any) -> str:
    """A failed line's error message, from the answer stored for its error file."""
    if isinstance(response, dict):
        body = response.get("body", response)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            return str(error.get("message", ""))[:500]
    return ""


@login_required
@require_GET
def batch_file(request: HttpRequest, slug: str, file_id: str) -> HttpResponseBase:
    """A batch's input, output or error file, as the Files API's ``/content`` gives it."""
    access = page_access(request, slug, Perm.BATCHES_MANAGE)
    try:
        found = batch_files.file_get(tenant=access.tenant, file_id=file_id)
    except ApiError:
        raise Http404("No such file.") from None
    return batch_files.file_download(file=found)
