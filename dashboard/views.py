"""The dashboard's pages: thin views over the same selectors and services as the control API.

Every tenant page takes the tenant's slug from the URL and goes through ``page_access``: an
outsider gets 404, a member whose role does not allow the page 403 (and the links to what a
role may not do are not shown in the first place).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from dashboard import forms, selectors
from dashboard.access import page_access, page_user
from tenants import selectors as tenant_selectors
from tenants import services
from tenants.access import Perm, TenantAccess
from tenants.models import Adapter, ApiKey

CHART_DAYS = 30


def _context(
    request: HttpRequest, access: TenantAccess, section: str, **extra: Any
) -> dict[str, Any]:
    """What every tenant page's layout needs: the tenant, the role, the tenant switcher."""
    return {
        "tenant": access.tenant,
        "access": access,
        "role": access.role or ("staff" if access.is_staff else ""),
        "can": {perm.name.lower(): access.can(perm) for perm in Perm},
        "section": section,
        "tenants": tenant_selectors.tenant_list_for_user(user=page_user(request)).order_by("slug")[
            :50
        ],
        **extra,
    }


@login_required
@require_GET
def home(request: HttpRequest) -> HttpResponse:
    """The first tenant the user belongs to (the switcher in the header reaches the others)."""
    tenant = tenant_selectors.tenant_list_for_user(user=page_user(request)).order_by("slug").first()
    if tenant is None:
        return render(request, "dashboard/no_tenant.html", status=200)
    return redirect("dashboard:overview", slug=tenant.slug)


@login_required
@require_GET
def overview(request: HttpRequest, slug: str) -> HttpResponse:
    access = page_access(request, slug)
    tenant = access.tenant
    today = timezone.now().date()
    summary = selectors.month_summary(tenant=tenant, today=today)
    budget = tenant.monthly_spend_budget_micros
    token_budget = tenant.monthly_token_budget
    context = _context(
        request,
        access,
        "overview",
        summary=summary,
        spend_usd=summary["cost"] / 1_000_000,
        budget_usd=budget / 1_000_000 if budget is not None else None,
        budget_percent=min(100, round(100 * summary["cost"] / budget)) if budget else None,
        token_budget=token_budget,
        token_percent=(
            min(100, round(100 * summary["tokens"] / token_budget)) if token_budget else None
        ),
        limits=[
            ("Requests per minute", tenant.rpm),
            ("Tokens per minute", tenant.tpm),
            ("Requests in flight", tenant.max_concurrency),
            ("max_tokens per request", tenant.max_tokens_per_request),
        ],
        chart=selectors.daily_chart(
            tenant=tenant, start=today - timedelta(days=CHART_DAYS - 1), days=CHART_DAYS
        ),
        problems=selectors.recent_problems(tenant=tenant),
    )
    return render(request, "dashboard/overview.html", context)


# --- API keys --------------------------------------------------------------------------


def _may_change(request: HttpRequest, access: TenantAccess, key: ApiKey) -> bool:
    """Owners and admins change any key; developers only the keys they created."""
    if access.can(Perm.KEYS_MANAGE_ANY):
        return True
    return access.can(Perm.KEYS_CREATE) and key.created_by_id == page_user(request).pk


def _keys_page(
    request: HttpRequest,
    access: TenantAccess,
    *,
    form: forms.KeyCreateForm | None = None,
    issued: services.IssuedKey | None = None,
    status: int = 200,
) -> HttpResponse:
    keys = tenant_selectors.api_key_list(tenant=access.tenant).select_related("created_by")
    rows = [{"key": k, "may_change": _may_change(request, access, k)} for k in keys[:200]]
    context = _context(
        request,
        access,
        "keys",
        rows=rows,
        form=form or forms.KeyCreateForm(),
        rotate_form=forms.KeyRotateForm(),
        issued=issued,
    )
    response = render(request, "dashboard/keys.html", context, status=status)
    if issued is not None:
        response["Cache-Control"] = "no-store"  # the secret is in this page, once
    return response


@login_required
@require_http_methods(["GET", "POST"])
def keys(request: HttpRequest, slug: str) -> HttpResponse:
    access = page_access(request, slug)
    if request.method == "GET":
        return _keys_page(request, access)
    if not access.can(Perm.KEYS_CREATE):
        raise PermissionDenied("Your role does not allow creating keys.")
    form = forms.KeyCreateForm(request.POST)
    if not form.is_valid():
        return _keys_page(request, access, form=form, status=400)
    try:
        issued = services.api_key_create(
            tenant=access.tenant,
            name=form.cleaned_data["name"],
            scopes=form.cleaned_data["scopes"],
            created_by=page_user(request),
        )
    except ValidationError as exc:
        _form_errors(form, exc)
        return _keys_page(request, access, form=form, status=400)
    # Rendered, not redirected: the secret exists only in this response.
    return _keys_page(request, access, issued=issued)


def _key(request: HttpRequest, access: TenantAccess, key_id: int) -> ApiKey:
    try:
        key = tenant_selectors.api_key_get(tenant=access.tenant, key_id=key_id)
    except ApiKey.DoesNotExist:
        raise Http404("No such key.") from None
    if not _may_change(request, access, key):
        raise PermissionDenied("You can only change keys you created.")
    return key


@login_required
@require_POST
def key_revoke(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    access = page_access(request, slug, Perm.KEYS_CREATE)
    services.api_key_revoke(api_key=_key(request, access, key_id), actor=page_user(request))
    return redirect("dashboard:keys", slug=slug)


@login_required
@require_POST
def key_rotate(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    access = page_access(request, slug, Perm.KEYS_CREATE)
    key = _key(request, access, key_id)
    form = forms.KeyRotateForm(request.POST)
    if not form.is_valid():
        return _keys_page(request, access, status=400)
    try:
        issued = services.api_key_rotate(
            api_key=key,
            actor=page_user(request),
            grace_seconds=form.cleaned_data["grace_hours"] * 3600,
        )
    except ValidationError as exc:
        create = forms.KeyCreateForm()
        _form_errors(create, exc)
        return _keys_page(request, access, form=create, status=400)
    return _keys_page(request, access, issued=issued)


def _form_errors(form: Any, exc: ValidationError) -> None:
    messages = exc.message_dict if hasattr(exc, "error_dict") else {None: exc.messages}
    for field, errors in messages.items():
        for error in errors:
            form.add_error(field if field in form.fields else None, error)


# --- LoRA adapters ---------------------------------------------------------------------


def _adapter_rows(access: TenantAccess) -> dict[str, Any]:
    adapters = list(
        tenant_selectors.adapter_list(tenant=access.tenant).select_related("base_model")[:200]
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
                    services.adapter_upload(
                        tenant=access.tenant,
                        name=form.cleaned_data["name"],
                        files=form.files_given(),
                        actor=page_user(request),
                    )
                except ValidationError as exc:
                    _form_errors(form, exc)
                else:
                    return HttpResponseRedirect(reverse("dashboard:adapters", args=[slug]))
    context = _context(
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
    context = {"tenant": access.tenant, "can": _context(request, access, "")["can"]}
    return render(request, "dashboard/_adapter_rows.html", {**context, **_adapter_rows(access)})


@login_required
@require_POST
def adapter_delete(request: HttpRequest, slug: str, name: str, version: int) -> HttpResponse:
    access = page_access(request, slug, Perm.ADAPTERS_MANAGE)
    try:
        adapter = tenant_selectors.adapter_get(tenant=access.tenant, name=name, version=version)
    except Adapter.DoesNotExist:
        raise Http404("No such adapter.") from None
    services.adapter_delete(adapter=adapter, actor=page_user(request))
    return redirect("dashboard:adapters", slug=slug)
