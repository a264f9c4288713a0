"""A tenant's API keys: the list and a new key (shown once), one key's limits, revoking and
rotating."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
)
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from dashboard import forms
from dashboard.access import page_access, page_user
from dashboard.views.common import form_errors, page_context
from tenants import selectors as tenant_selectors
from tenants import services
from tenants.access import Perm, TenantAccess
from tenants.models import ApiKey

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
    listed = list(keys[:200])
    rows = {k.pk: {"key": k, "may_change": _may_change(request, access, k)} for k in listed}
    # Keys that work first; the expired and revoked (a playground tab's key after 12 hours)
    # folded away below them, so they do not pile up in the list.
    context = page_context(
        request,
        access,
        "keys",
        rows=[rows[k.pk] for k in listed if k.is_active],
        ended=[rows[k.pk] for k in listed if not k.is_active],
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
        days = form.cleaned_data["expires_in_days"]
        issued = services.api_key_create(
            tenant=access.tenant,
            name=form.cleaned_data["name"],
            scopes=form.cleaned_data["scopes"],
            created_by=page_user(request),
            expires_at=timezone.now() + timedelta(days=days) if days else None,
        )
    except ValidationError as exc:
        form_errors(form, exc)
        return _keys_page(request, access, form=form, status=400)
    # Rendered, not redirected: the secret exists only in this response.
    return _keys_page(request, access, issued=issued)


@login_required
@require_http_methods(["GET", "POST"])
def key_detail(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    """One key: what it is, its limits beside the tenant's (which apply where it has none),
    changed by owners and admins through the service the control API uses."""
    access = page_access(request, slug)
    try:
        key = tenant_selectors.api_key_get(tenant=access.tenant, key_id=key_id)
    except ApiKey.DoesNotExist:
        raise Http404("No such key.") from None
    form = forms.KeyLimitsForm.for_key(key)
    status = 200
    if request.method == "POST":
        if not access.can(Perm.KEY_LIMITS_EDIT):
            raise PermissionDenied("Your role does not allow changing key limits.")
        form = forms.KeyLimitsForm(request.POST)
        if form.is_valid():
            try:
                with transaction.atomic():
                    services.api_key_limits_update(
                        api_key=key, actor=page_user(request), limits=form.limits()
                    )
                    services.api_key_priority_update(
                        api_key=key,
                        actor=page_user(request),
                        priority_class=form.cleaned_data["priority_class"],
                    )
            except ValidationError as exc:
                form_errors(form, exc)
            else:
                return redirect("dashboard:key", slug=slug, key_id=key.pk)
        status = 400
    tenant = access.tenant
    rows = [
        (field.label, getattr(key, name), getattr(tenant, name))
        for name, field in ((n, form.fields[n]) for n in form.LIMITS)
    ]
    context = page_context(
        request,
        access,
        "keys",
        key=key,
        form=form,
        rows=rows,
        spend=(key.monthly_spend_budget_micros, tenant.monthly_spend_budget_micros),
    )
    return render(request, "dashboard/key.html", context, status=status)


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
        form_errors(create, exc)
        return _keys_page(request, access, form=create, status=400)
    return _keys_page(request, access, issued=issued)
