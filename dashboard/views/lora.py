"""A tenant's LoRA adapters: uploads (validated by ``adapters``), their states, deletion."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
)
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from adapters import selectors as adapter_selectors
from adapters import services as adapter_services
from adapters.models import Adapter
from dashboard import forms
from dashboard.access import page_access, page_user
from dashboard.views.common import can, form_errors, page_context
from tenants.access import Perm, TenantAccess

# --- LoRA adapters ---------------------------------------------------------------------


def _adapter_rows(access: TenantAccess) -> dict[str, Any]:
    adapters = list(
        adapter_selectors.adapter_list(tenant=access.tenant).select_related("base_model")[:200]
    )
    return {
        "adapters": adapters,
        "validating": any(a.status == Adapter.Status.VALIDATING for a in adapters),
    }


@login_required
@require_http_methods(["GET", "POST"])
def adapters(request: HttpRequest, slug: str) -> HttpResponse:
    access = page_access(request, slug)
    form = forms.AdapterUploadForm()
    status, too_big = 200, ""
    if request.method == "POST":
        if not access.can(Perm.ADAPTERS_MANAGE):
            raise PermissionDenied("Your role does not allow uploading adapters.")
        status = 400  # unless the upload is taken below
        if int(request.META.get("CONTENT_LENGTH") or 0) > settings.ADAPTER_MAX_BYTES:
            # Refused before the body is read.
            status, too_big = 413, f"Adapters are limited to {settings.ADAPTER_MAX_BYTES:,} bytes."
        else:
            form = forms.AdapterUploadForm(request.POST, request.FILES)
            if form.is_valid():
                try:
                    adapter_services.adapter_upload(
                        tenant=access.tenant,
                        name=form.cleaned_data["name"],
                        files=form.files_given(),
                        actor=page_user(request),
                    )
                except ValidationError as exc:
                    form_errors(form, exc)
                else:
                    return HttpResponseRedirect(reverse("dashboard:adapters", args=[slug]))
    context = page_context(
        request,
        access,
        "adapters",
        form=form,
        too_big=too_big,
        max_bytes=settings.ADAPTER_MAX_BYTES,
        **_adapter_rows(access),
    )
    return render(request, "dashboard/adapters.html", context, status=status)


@login_required
@require_GET
def adapter_rows(request: HttpRequest, slug: str) -> HttpResponse:
    """The adapter table alone: polled while a version is validating."""
    access = page_access(request, slug)
    context = {"tenant": access.tenant, "can": can(access)}
    return render(request, "dashboard/_adapter_rows.html", {**context, **_adapter_rows(access)})


@login_required
@require_POST
def adapter_delete(request: HttpRequest, slug: str, name: str, version: int) -> HttpResponse:
    access = page_access(request, slug, Perm.ADAPTERS_MANAGE)
    try:
        adapter = adapter_selectors.adapter_get(tenant=access.tenant, name=name, version=version)
    except Adapter.DoesNotExist:
        raise Http404("No such adapter.") from None
    adapter_services.adapter_delete(adapter=adapter, actor=page_user(request))
    return redirect("dashboard:adapters", slug=slug)
