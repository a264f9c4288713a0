"""The dashboard's pages: thin views over the same selectors and services as the control API.

Every tenant page takes the tenant's slug from the URL and goes through ``page_access``: an
outsider gets 404, a member whose role does not allow the page 403 (and the links to what a
role may not do are not shown in the first place).
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import login as auth_login
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db import transaction
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    JsonResponse,
)
from django.http.response import HttpResponseBase
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from redis.exceptions import RedisError

from adapters import selectors as adapter_selectors
from adapters import services as adapter_services
from adapters.models import Adapter
from batches import files as batch_files
from batches import quotas as batch_quotas
from batches import selectors as batch_selectors
from batches import services as batch_services
from batches import wire as batch_wire
from batches.models import Batch
from billing.exports import spreadsheet_safe
from billing.invoicing import invoice_finalize, invoice_void
from billing.models import Invoice
from billing.pricing import micros_to_usd
from billing.selectors import invoice_get, invoice_list, price_list
from billing.services import price_set
from dashboard import forms, selectors
from dashboard.access import page_access, page_user
from fleet.models import Pool, Replica
from inference import selectors as inference_selectors
from inference import services as inference_services
from inference.gateway.errors import ApiError
from moderation import selectors as moderation_selectors
from moderation import services as moderation_services
from moderation.categories import CATEGORIES
from moderation.policy import PolicyInvalid
from tenants import selectors as tenant_selectors
from tenants import services
from tenants.access import Perm, TenantAccess
from tenants.keys import KEY_TAG
from tenants.models import ApiKey, Invitation, Membership, Role, Tenant
from tenants.priority import DEFAULT_CLASS

CHART_DAYS = 30


def _can(access: TenantAccess) -> dict[str, bool]:
    """What the templates may offer: ``can.keys_create``, ``can.billing_view``, ..."""
    return {perm.name.lower(): access.can(perm) for perm in Perm}


def _context(
    request: HttpRequest, access: TenantAccess, section: str, **extra: Any
) -> dict[str, Any]:
    """What every tenant page's layout needs: the tenant, the role, the tenant switcher."""
    return {
        "tenant": access.tenant,
        "access": access,
        "role": access.role or ("staff" if access.is_staff else ""),
        "can": _can(access),
        "section": section,
        "tenants": tenant_selectors.tenant_list_for_user(user=page_user(request)).order_by("slug")[
            :50
        ],
        **extra,
    }


@login_required
@require_GET
def home(request: HttpRequest) -> HttpResponse:
    """The first tenant the user belongs to; or, from the header's switcher
    (``?tenant=<slug>&section=<page>``), that tenant's same page when the user's role there
    allows it, its overview otherwise."""
    user = page_user(request)
    mine = tenant_selectors.tenant_list_for_user(user=user).order_by("slug")
    tenant = mine.filter(slug=request.GET.get("tenant", "")).first() or mine.first()
    if tenant is None:
        return render(request, "dashboard/no_tenant.html", status=200)
    section = request.GET.get("section", "")
    if section in SECTION_PERMS:
        try:
            page_access(request, tenant.slug, SECTION_PERMS[section])
        except PermissionDenied:
            pass
        else:
            return redirect(f"dashboard:{section}", slug=tenant.slug)
    return redirect("dashboard:overview", slug=tenant.slug)


# The tenant pages the switcher keeps, each with what a role needs to open it.
SECTION_PERMS = {
    "overview": Perm.VIEW,
    "keys": Perm.VIEW,
    "usage": Perm.BILLING_VIEW,
    "invoices": Perm.BILLING_VIEW,
    "playground": Perm.KEYS_CREATE,
    "limits": Perm.VIEW,
    "moderation": Perm.VIEW,
    "cache": Perm.VIEW,
    "members": Perm.VIEW,
    "adapters": Perm.VIEW,
    "batches": Perm.VIEW,
    "audit": Perm.AUDIT_VIEW,
}


@login_required
@require_GET
def overview(request: HttpRequest, slug: str) -> HttpResponse:
    """The month so far: its tiles (requests, tokens, spend; refreshed every 5 s), tokens
    and spend by day, the limits, and recent problems and 429s."""
    access = page_access(request, slug)
    tenant = access.tenant
    today = timezone.now().date()
    tiles = _overview_tiles(tenant, today)
    if request.GET.get("fragment"):
        return render(request, "dashboard/_overview_tiles.html", {"tenant": tenant, **tiles})
    context = _context(
        request,
        access,
        "overview",
        **tiles,
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


def _overview_tiles(tenant: Tenant, today: date) -> dict[str, Any]:
    summary = selectors.month_summary(tenant=tenant, today=today)
    budget = tenant.monthly_spend_budget_micros
    token_budget = tenant.monthly_token_budget
    return {
        "summary": summary,
        "spend_micros": summary["cost"],
        "budget_micros": budget,
        "budget_percent": min(100, round(100 * summary["cost"] / budget)) if budget else None,
        "token_budget": token_budget,
        "token_percent": (
            min(100, round(100 * summary["tokens"] / token_budget)) if token_budget else None
        ),
        "rejections": selectors.rejections(tenant=tenant, today=today),
    }


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
    context = _context(
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
        _form_errors(form, exc)
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
                _form_errors(form, exc)
            else:
                return redirect("dashboard:key", slug=slug, key_id=key.pk)
        status = 400
    tenant = access.tenant
    rows = [
        (field.label, getattr(key, name), getattr(tenant, name))
        for name, field in ((n, form.fields[n]) for n in form.LIMITS)
    ]
    context = _context(
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
    context = {"tenant": access.tenant, "can": _can(access)}
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
    context = _context(
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
    context = {"tenant": access.tenant, "can": _can(access), **_batch_rows(access)}
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
        context = _context(request, access, "batches", error=error.message, **_batch_rows(access))
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
    context = _context(
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


# --- Members and invitations -------------------------------------------------------------


def _members_page(
    request: HttpRequest,
    access: TenantAccess,
    *,
    invite_form: forms.InviteForm | None = None,
    issued: services.IssuedInvitation | None = None,
    error: str = "",
    status: int = 200,
) -> HttpResponse:
    tenant = access.tenant
    manage = access.can(Perm.MEMBERS_MANAGE)
    context = _context(
        request,
        access,
        "members",
        memberships=tenant_selectors.membership_list(tenant=tenant).order_by("user__username"),
        invitations=tenant_selectors.invitation_list_open(tenant=tenant) if manage else [],
        invite_form=invite_form or forms.InviteForm(),
        roles=Role.choices,
        grantable=[
            r
            for r in Role.values
            if access.role == Role.OWNER or access.is_staff or r != Role.OWNER
        ],
        issued=issued,
        join_url=(
            request.build_absolute_uri(reverse("dashboard:join", args=[issued.token]))
            if issued
            else ""
        ),
        error=error,
    )
    response = render(request, "dashboard/members.html", context, status=status)
    if issued is not None:
        response["Cache-Control"] = "no-store"
    return response


def _actor_role(access: TenantAccess) -> str | None:
    """The role the owner rules check: staff act as owners (None)."""
    return None if access.is_staff else access.role


@login_required
@require_http_methods(["GET", "POST"])
def members(request: HttpRequest, slug: str) -> HttpResponse:
    """Everyone in the tenant sees who is in it; owners and admins invite (POST)."""
    access = page_access(request, slug)
    if request.method == "GET":
        return _members_page(request, access)
    if not access.can(Perm.MEMBERS_MANAGE):
        raise PermissionDenied("Your role does not allow inviting members.")
    form = forms.InviteForm(request.POST)
    if not form.is_valid():
        return _members_page(request, access, invite_form=form, status=400)
    try:
        issued = services.invitation_create(
            tenant=access.tenant,
            role=form.cleaned_data["role"],
            actor=page_user(request),
            actor_role=_actor_role(access),
        )
    except PermissionDenied as exc:
        return _members_page(request, access, invite_form=form, error=str(exc), status=403)
    return _members_page(request, access, issued=issued)


def _membership(access: TenantAccess, member_id: int) -> Membership:
    try:
        return tenant_selectors.membership_get(tenant=access.tenant, membership_id=member_id)
    except Membership.DoesNotExist:
        raise Http404("No such member.") from None


@login_required
@require_POST
def member_role(request: HttpRequest, slug: str, member_id: int) -> HttpResponse:
    access = page_access(request, slug, Perm.MEMBERS_MANAGE)
    membership = _membership(access, member_id)
    form = forms.RoleForm(request.POST)
    if not form.is_valid():
        return _members_page(request, access, error="Choose a role.", status=400)
    try:
        services.membership_change_role(
            membership=membership,
            role=form.cleaned_data["role"],
            actor=page_user(request),
            actor_role=_actor_role(access),
        )
    except (ValidationError, PermissionDenied) as exc:
        status = 403 if isinstance(exc, PermissionDenied) else 400
        return _members_page(request, access, error=_message(exc), status=status)
    return redirect("dashboard:members", slug=slug)


@login_required
@require_POST
def member_remove(request: HttpRequest, slug: str, member_id: int) -> HttpResponse:
    access = page_access(request, slug, Perm.MEMBERS_MANAGE)
    membership = _membership(access, member_id)
    try:
        services.membership_remove(
            membership=membership, actor=page_user(request), actor_role=_actor_role(access)
        )
    except (ValidationError, PermissionDenied) as exc:
        status = 403 if isinstance(exc, PermissionDenied) else 400
        return _members_page(request, access, error=_message(exc), status=status)
    return redirect("dashboard:members", slug=slug)


@login_required
@require_POST
def invitation_revoke(request: HttpRequest, slug: str, invitation_id: int) -> HttpResponse:
    access = page_access(request, slug, Perm.MEMBERS_MANAGE)
    try:
        invitation = tenant_selectors.invitation_get(
            tenant=access.tenant, invitation_id=invitation_id
        )
    except Invitation.DoesNotExist:
        raise Http404("No such invitation.") from None
    services.invitation_revoke(invitation=invitation, actor=page_user(request))
    return redirect("dashboard:members", slug=slug)


def _message(exc: ValidationError | PermissionDenied) -> str:
    if isinstance(exc, ValidationError):
        return " ".join(exc.messages)
    return str(exc)


@require_http_methods(["GET", "POST"])
def join(request: HttpRequest, token: str) -> HttpResponse:
    """An invitation link. Logged in: join with one click. Otherwise: sign up (or log in and
    come back) — the link is not used up until someone joins with it."""
    invitation = services.invitation_find(token=token)
    if invitation is None:
        return render(request, "dashboard/join.html", {"invalid": True}, status=404)
    signup = forms.SignUpForm()
    if request.method == "POST":
        context: dict[str, Any] = {"invitation": invitation, "signup": signup}
        signing_up = not request.user.is_authenticated
        if signing_up:
            signup = context["signup"] = forms.SignUpForm(request.POST)
            if not signup.is_valid():
                return render(request, "dashboard/join.html", context, status=400)
        try:
            with transaction.atomic():  # a new account only if the link still works
                user = signup.save() if signing_up else page_user(request)
                services.invitation_accept(token=token, user=user)
        except ValidationError as exc:
            context["error"] = _message(exc)
            return render(request, "dashboard/join.html", context, status=400)
        if signing_up:
            auth_login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        return redirect("dashboard:overview", slug=invitation.tenant.slug)
    return render(request, "dashboard/join.html", {"invitation": invitation, "signup": signup})


# --- Audit log -----------------------------------------------------------------------------

AUDIT_PAGE = 50


@login_required
@require_GET
def audit(request: HttpRequest, slug: str) -> HttpResponse:
    access = page_access(request, slug, Perm.AUDIT_VIEW)
    form = forms.AuditFilterForm(request.GET)
    events = tenant_selectors.audit_event_list(tenant=access.tenant)
    status = 200
    if form.is_valid():
        since = form.cleaned_data["since"]
        events = tenant_selectors.audit_event_list(
            tenant=access.tenant,
            action=form.cleaned_data["action"] or None,
            since=datetime(since.year, since.month, since.day, tzinfo=UTC) if since else None,
        )
        if form.cleaned_data["actor"]:
            events = events.filter(actor_label=form.cleaned_data["actor"])
    else:
        status = 400
    page = Paginator(events.order_by("-created_at", "-id"), AUDIT_PAGE).get_page(
        request.GET.get("page")
    )
    query = request.GET.copy()
    query.pop("page", None)
    context = _context(request, access, "audit", form=form, page=page, query=query.urlencode())
    return render(request, "dashboard/audit.html", context, status=status)


# --- Moderation -----------------------------------------------------------------------------

MODERATION_EVENTS_PAGE = 50


@login_required
@require_http_methods(["GET", "POST"])
def moderation(request: HttpRequest, slug: str) -> HttpResponse:
    """The tenant's moderation policy (owners and admins change it) and what it recorded
    (for those who may read the audit log)."""
    access = page_access(request, slug)
    policy = moderation_selectors.moderation_policy_get(tenant=access.tenant)
    form = forms.ModerationPolicyForm(initial=forms.ModerationPolicyForm.initial_for(policy))
    status = 200
    if request.method == "POST":
        if not access.can(Perm.MODERATION_MANAGE):
            raise PermissionDenied("Your role does not allow changing the moderation policy.")
        form = forms.ModerationPolicyForm(request.POST)
        if form.is_valid():
            try:
                moderation_services.moderation_policy_set(
                    tenant=access.tenant,
                    changes=form.changes(list(CATEGORIES)),
                    actor=page_user(request),
                )
            except PolicyInvalid as exc:
                field = exc.field if exc.field in form.fields else None
                form.add_error(field, exc.message)
            else:
                return redirect("dashboard:moderation", slug=slug)
        status = 400
    events = None
    if access.can(Perm.AUDIT_VIEW):
        events = Paginator(
            moderation_selectors.moderation_events_list(tenant=access.tenant),
            MODERATION_EVENTS_PAGE,
        ).get_page(request.GET.get("page"))
    context = _context(request, access, "moderation", form=form, policy=policy, events=events)
    return render(request, "dashboard/moderation.html", context, status=status)


@login_required
@require_http_methods(["GET", "POST"])
def cache(request: HttpRequest, slug: str) -> HttpResponse:
    """The tenant's response cache (docs/cache.md): on or off and its TTL (owners and admins
    change them), and how many of this month's requests it answered."""
    access = page_access(request, slug)
    tenant = access.tenant
    form = forms.CacheForm(
        initial={
            "mode": tenant.response_cache,
            "ttl_seconds": tenant.response_cache_ttl_seconds,
            "threshold": tenant.response_cache_threshold,
            "embedding_model": tenant.response_cache_embedding_model,
        }
    )
    status = 200
    if request.method == "POST":
        if not access.can(Perm.CACHE_MANAGE):
            raise PermissionDenied("Your role does not allow changing the response cache.")
        form = forms.CacheForm(request.POST)
        if form.is_valid():
            try:
                services.tenant_cache_update(
                    tenant=tenant,
                    actor=page_user(request),
                    mode=form.cleaned_data["mode"],
                    ttl_seconds=form.cleaned_data["ttl_seconds"],
                    threshold=form.cleaned_data["threshold"],
                    embedding_model=form.cleaned_data["embedding_model"],
                )
            except ValidationError as exc:
                _form_errors(form, exc)
            else:
                return redirect("dashboard:cache", slug=slug)
        status = 400
    month = selectors.month_summary(tenant=tenant, today=timezone.now().date())
    context = _context(
        request, access, "cache", form=form, month=month, purged=request.GET.get("purged")
    )
    return render(request, "dashboard/cache.html", context, status=status)


@login_required
@require_POST
def cache_purge(request: HttpRequest, slug: str) -> HttpResponse:
    access = page_access(request, slug, Perm.CACHE_MANAGE)
    try:
        purged = inference_services.response_cache_purge(
            tenant=access.tenant, actor=page_user(request)
        )
    except RedisError:
        return HttpResponse(
            "The cache cannot be reached right now; nothing was purged. Try again shortly.",
            status=503,
            content_type="text/plain; charset=utf-8",
        )
    return redirect(f"{reverse('dashboard:cache', args=[slug])}?purged={purged}")


# --- Usage explorer and invoices ----------------------------------------------------------


def _usage_selection(request: HttpRequest, access: TenantAccess) -> tuple[Any, dict[str, Any]]:
    """The explorer's form (defaults: the last 30 days) and the rows it selects."""
    today = timezone.now().date()
    data = {"start": (today - timedelta(days=CHART_DAYS - 1)).isoformat(), "end": today.isoformat()}
    data.update({k: str(v) for k, v in request.GET.items() if v != ""})
    form = forms.UsageFilterForm(data)
    if not form.is_valid():
        return form, {}
    key_id = form.cleaned_data["key"]
    if (
        key_id is not None
        and not tenant_selectors.api_key_list(tenant=access.tenant).filter(pk=key_id).exists()
    ):
        form.add_error("key", "No such key in this tenant.")
        return form, {}
    start, end = form.cleaned_data["start"], form.cleaned_data["end"]
    rows = selectors.usage_rows(
        tenant=access.tenant,
        start=start,
        end=end,
        model=form.cleaned_data["model"],
        api_key_id=key_id,
        mode=form.cleaned_data["mode"],
    )
    return form, {"rows": rows, "start": start, "days": (end - start).days + 1}


@login_required
@require_GET
def usage(request: HttpRequest, slug: str) -> HttpResponse:
    access = page_access(request, slug, Perm.BILLING_VIEW)
    form, selection = _usage_selection(request, access)
    rows = selection.get("rows", [])
    totals = {
        name: sum(r[name] for r in rows)
        for name in (
            "requests",
            "errors",
            "cache_hits",
            "prompt_tokens",
            "completion_tokens",
            "cost_micros",
        )
    }
    context = _context(
        request,
        access,
        "usage",
        form=form,
        rows=rows,
        totals=totals,
        spend_micros=totals["cost_micros"],
        chart=selectors.usage_chart(rows, start=selection["start"], days=selection["days"])
        if selection
        else None,
        models=selectors.usage_models(
            tenant=access.tenant, since=timezone.now().date() - timedelta(days=366)
        ),
        keys=tenant_selectors.api_key_list(tenant=access.tenant)[:200],
        csv_query=request.GET.urlencode(),
    )
    return render(request, "dashboard/usage.html", context, status=200 if selection else 400)


@login_required
@require_GET
def usage_csv(request: HttpRequest, slug: str) -> HttpResponse:
    """The explorer's selection as CSV: exactly the rows of its table."""
    access = page_access(request, slug, Perm.BILLING_VIEW)
    form, selection = _usage_selection(request, access)
    if not selection:
        errors = "; ".join(f"{k}: {' '.join(v)}" for k, v in form.errors.items())
        return HttpResponse(errors, status=400, content_type="text/plain; charset=utf-8")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        [
            "day", "model", "adapter", "api_key", "mode", "priority", "requests", "errors",
            "cache_hits", "prompt_tokens", "completion_tokens", "cached_tokens", "cost_usd",
            "api_key_name",
        ]
    )  # fmt: skip
    for r in selection["rows"]:
        writer.writerow(
            [
                r["day"].isoformat(),
                r["model"],
                r["adapter"],
                f"{KEY_TAG}{r['api_key__prefix']}" if r["api_key__prefix"] else "",
                r["mode"],
                r["priority"],
                r["requests"],
                r["errors"],
                r["cache_hits"],
                r["prompt_tokens"],
                r["completion_tokens"],
                r["cached_tokens"],
                micros_to_usd(r["cost_micros"]),
                spreadsheet_safe(r["api_key__name"] or ""),
            ]
        )
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    name = f"{slug}-usage-{form.cleaned_data['start']}-{form.cleaned_data['end']}.csv"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


@login_required
@require_GET
def invoices(request: HttpRequest, slug: str) -> HttpResponse:
    access = page_access(request, slug, Perm.BILLING_VIEW)
    context = _context(
        request, access, "invoices", invoices=invoice_list(tenant=access.tenant)[:120]
    )
    return render(request, "dashboard/invoices.html", context)


@login_required
@require_GET
def invoice(request: HttpRequest, slug: str, invoice_id: int) -> HttpResponse:
    access = page_access(request, slug, Perm.BILLING_VIEW)
    return _invoice_page(request, access, _invoice_of(access, invoice_id))


def _invoice_of(access: TenantAccess, invoice_id: int) -> Invoice:
    try:
        return invoice_get(tenant=access.tenant, invoice_id=invoice_id)
    except Invoice.DoesNotExist:
        raise Http404("No such invoice.") from None


def _invoice_page(
    request: HttpRequest, access: TenantAccess, found: Invoice, error: str = "", status: int = 200
) -> HttpResponse:
    # The first day after the invoice's month: it can be finalized from then on.
    month_end = (found.period_start.replace(day=28) + timedelta(days=4)).replace(day=1)
    context = _context(
        request,
        access,
        "invoices",
        invoice=found,
        lines=found.lines.all(),
        error=error,
        month_end=month_end,
        month_over=month_end <= timezone.now().date(),
    )
    return render(request, "dashboard/invoice.html", context, status=status)


@login_required
@require_POST
def invoice_change(request: HttpRequest, slug: str, invoice_id: str, action: str) -> HttpResponse:
    """Platform staff finalize a month's draft (frozen, sent to Stripe) or void a finalized
    invoice: the services and rules of the control API's ``invoices/finalize/`` and
    ``invoices/ID/void/``."""
    access = page_access(request, slug, Perm.PLATFORM)
    found = _invoice_of(access, int(invoice_id))
    actor = page_user(request)
    try:
        if action == "finalize":
            invoice_finalize(tenant=access.tenant, period_start=found.period_start, actor=actor)
        else:
            invoice_void(invoice=found, actor=actor)
    except ValidationError as exc:
        found = _invoice_of(access, found.pk)
        return _invoice_page(request, access, found, error=" ".join(exc.messages), status=400)
    return redirect("dashboard:invoice", slug=slug, invoice_id=found.pk)


# --- Limits and budgets ------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def limits(request: HttpRequest, slug: str) -> HttpResponse:
    """Everyone in the tenant sees its limits and budgets; platform staff change them."""
    access = page_access(request, slug)
    tenant = access.tenant
    form = forms.TenantLimitsForm.for_tenant(tenant)
    status = 200
    if request.method == "POST":
        if not access.can(Perm.PLATFORM):
            raise PermissionDenied("Only platform staff change a tenant's limits.")
        form = forms.TenantLimitsForm(request.POST)
        if form.is_valid():
            try:
                with transaction.atomic():
                    services.tenant_limits_update(
                        tenant=tenant, actor=page_user(request), limits=form.limits()
                    )
                    services.tenant_update(
                        tenant=tenant,
                        actor=page_user(request),
                        weight=form.cleaned_data["weight"],
                        priority_class=form.cleaned_data["priority_class"] or None,
                        status=form.cleaned_data["status"],
                    )
            except ValidationError as exc:
                _form_errors(form, exc)
            else:
                return redirect("dashboard:limits", slug=slug)
        status = 400
    rows = [(form.fields[name].label, getattr(tenant, name)) for name in form.LIMITS]
    budget = tenant.monthly_spend_budget_micros
    context = _context(
        request,
        access,
        "limits",
        form=form,
        rows=rows,
        quotas=[(use, getattr(tenant, use.name) is None) for use in batch_quotas.quota_use(tenant)],
        retention_days=settings.INFERPLANE_RETENTION_DAYS,
        spend_budget_micros=budget,
    )
    return render(request, "dashboard/limits.html", context, status=status)


# --- Operator ------------------------------------------------------------------------------


def _staff(request: HttpRequest) -> None:
    if not page_user(request).is_staff:
        raise Http404("No such page.")  # not even its existence, for tenant users


@login_required
@require_GET
def ops(request: HttpRequest) -> HttpResponse:
    """Platform staff: pools, replicas and queues (the table refreshes itself every 2 s),
    model routes (canaries) and their changes, and the tenants, a page of 50 at a time,
    searchable."""
    _staff(request)
    if request.GET.get("fragment"):
        return render(request, "dashboard/_ops.html", selectors.ops_snapshot())
    return _ops_page(request, forms.RouteForm())


# What the operator page lists under "Recent changes": the fleet's and the price book's.
FLEET_ACTIONS = ("route.", "pool.", "replica.", "price.")
RECENT_CHANGES = 20


def _ops_page(
    request: HttpRequest,
    route_form: forms.RouteForm,
    status: int = 200,
    tenant_form: forms.TenantCreateForm | None = None,
) -> HttpResponse:
    query = request.GET.get("q", "").strip()[:100]
    context = {
        "section": "ops",
        **selectors.ops_snapshot(),
        "routes": inference_selectors.model_route_list(),
        "route_form": route_form,
        "tenant_form": tenant_form or forms.TenantCreateForm(),
        "tenants": selectors.ops_tenants(query=query, page=request.GET.get("page")),
        "query": query,
        "changes": tenant_selectors.platform_audit_event_list(actions=FLEET_ACTIONS)[
            :RECENT_CHANGES
        ],
    }
    return render(request, "dashboard/ops.html", context, status=status)


@login_required
@require_POST
def ops_route(request: HttpRequest) -> HttpResponse:
    """Set a model route's weights (or clear it): every web process follows within a second."""
    _staff(request)
    form = forms.RouteForm(request.POST)
    if request.POST.get("clear"):
        with transaction.atomic():
            inference_services.model_route_clear(
                name=request.POST.get("name", ""), actor=page_user(request)
            )
        return redirect("dashboard:ops")
    if form.is_valid():
        try:
            with transaction.atomic():
                inference_services.model_route_set(
                    name=form.cleaned_data["name"],
                    targets=form.cleaned_data["targets"],
                    actor=page_user(request),
                )
        except ValidationError as exc:
            form.add_error(None, exc)
        else:
            return redirect("dashboard:ops")
    return _ops_page(request, form, status=400)


def _pool_or_404(name: str) -> Pool:
    try:
        return inference_selectors.pool_get(name=name)
    except Pool.DoesNotExist:
        raise Http404("No such pool.") from None


@login_required
@require_http_methods(["GET", "POST"])
def ops_pool(request: HttpRequest, pool: str) -> HttpResponse:
    """One pool (platform staff): its replicas, live, with drain / ready / remove; a replica
    added by hand; its admission settings; and who changed it when. Every change goes
    through the service the control API and the commands call."""
    _staff(request)
    found = _pool_or_404(pool)
    if request.GET.get("fragment"):
        context = {**selectors.ops_snapshot(name=found.name), "manage": True}
        return render(request, "dashboard/_ops.html", context)
    if request.method == "GET":
        return _pool_page(request, found)
    # A fresh copy for the form to fill: the service compares against the stored pool.
    form = forms.PoolForm(request.POST, instance=_pool_or_404(pool))
    if form.is_valid():
        data = form.cleaned_data
        try:
            inference_services.pool_configure(
                pool=found,
                **{field: data[field] for field in forms.PoolForm.Meta.fields},
                discovery=data["replicas_from"],
                actor=page_user(request),
            )
        except ValidationError as exc:
            _form_errors(form, exc)
        else:
            return redirect("dashboard:ops-pool", pool=found.name)
    return _pool_page(request, found, pool_form=form, status=400)


def _pool_page(
    request: HttpRequest,
    pool: Pool,
    *,
    pool_form: forms.PoolForm | None = None,
    replica_form: forms.ReplicaAddForm | None = None,
    error: str = "",
    status: int = 200,
) -> HttpResponse:
    context = {
        "section": "ops",
        "pool": pool,
        **selectors.ops_snapshot(name=pool.name),
        "manage": True,
        "pool_form": pool_form
        or forms.PoolForm(instance=pool, initial={"replicas_from": pool.discovery_url}),
        "replica_form": replica_form or forms.ReplicaAddForm(),
        "error": error,
        "changes": tenant_selectors.platform_audit_event_list(
            actions=("pool.", "replica."), pool=pool.name
        )[:RECENT_CHANGES],
    }
    return render(request, "dashboard/pool.html", context, status=status)


@login_required
@require_POST
def ops_replica_add(request: HttpRequest, pool: str) -> HttpResponse:
    _staff(request)
    found = _pool_or_404(pool)
    form = forms.ReplicaAddForm(request.POST)
    if form.is_valid():
        try:
            inference_services.replica_add(
                pool=found,
                url=form.cleaned_data["url"],
                name=form.cleaned_data["name"],
                actor=page_user(request),
            )
        except ValidationError as exc:
            _form_errors(form, exc)
        else:
            return redirect("dashboard:ops-pool", pool=found.name)
    return _pool_page(request, found, replica_form=form, status=400)


@login_required
@require_POST
def ops_replica_change(
    request: HttpRequest, pool: str, replica_id: int, action: str
) -> HttpResponse:
    """Drain a replica, bring it back (probed first: ``ready`` or ``down``), or remove it
    (refused while requests run on it, unless forced)."""
    _staff(request)
    found = _pool_or_404(pool)
    try:
        replica = inference_selectors.replica_get(pool=found, replica_id=replica_id)
    except Replica.DoesNotExist:
        raise Http404("No such replica.") from None
    if action not in ("drain", "ready", "remove"):
        raise Http404("No such action.")
    actor = page_user(request)
    try:
        if action == "drain":
            inference_services.replica_drain(replica=replica, actor=actor)
        elif action == "ready":
            inference_services.replica_undrain(replica=replica, actor=actor)
        else:
            inference_services.replica_remove(
                replica=replica, force=request.POST.get("force") == "1", actor=actor
            )
    except ValidationError as exc:
        return _pool_page(request, found, error=" ".join(exc.messages), status=400)
    return redirect("dashboard:ops-pool", pool=found.name)


@login_required
@require_POST
def ops_tenant_create(request: HttpRequest) -> HttpResponse:
    """A new tenant (platform staff): then its limits page, to set its limits and budgets."""
    _staff(request)
    form = forms.TenantCreateForm(request.POST)
    if form.is_valid():
        try:
            tenant = services.tenant_create(
                slug=form.cleaned_data["slug"],
                name=form.cleaned_data["name"],
                weight=form.cleaned_data["weight"],
                priority_class=form.cleaned_data["priority_class"] or DEFAULT_CLASS,
                actor=page_user(request),
            )
        except ValidationError as exc:
            _form_errors(form, exc)
        else:
            return redirect("dashboard:limits", slug=tenant.slug)
    return _ops_page(request, forms.RouteForm(), status=400, tenant_form=form)


@login_required
@require_http_methods(["GET", "POST"])
def ops_prices(request: HttpRequest) -> HttpResponse:
    """The price book (platform staff): every price, newest first, and a new one added
    through the service ``set_price`` and the admin use (the past is never repriced)."""
    _staff(request)
    form = forms.PriceForm()
    status = 200
    if request.method == "POST":
        form = forms.PriceForm(request.POST)
        if form.is_valid():
            data = form.cleaned_data
            start = data["effective_from"]
            try:
                price_set(
                    model=data["model"],
                    tenant=data["tenant"],
                    input_per_mtok=data["input_per_mtok"],
                    cached_input_per_mtok=data["cached_input_per_mtok"],
                    output_per_mtok=data["output_per_mtok"],
                    batch_discount_percent=data["batch_discount_percent"],
                    interactive_surcharge_percent=data["interactive_surcharge_percent"],
                    background_discount_percent=data["background_discount_percent"],
                    effective_from=start.astimezone(UTC) if start else None,
                    actor=page_user(request),
                )
            except ValidationError as exc:
                _form_errors(form, exc)
            else:
                return redirect("dashboard:ops-prices")
        status = 400
    context = {"section": "ops", "form": form, "prices": price_list(), "now": timezone.now()}
    return render(request, "dashboard/prices.html", context, status=status)


# --- Playground ----------------------------------------------------------------------------

PLAYGROUND_KEY_HOURS = 12


@login_required
@require_GET
def playground(request: HttpRequest, slug: str) -> HttpResponse:
    access = page_access(request, slug)
    context = _context(
        request, access, "playground", models=selectors.playground_models(tenant=access.tenant)
    )
    return render(request, "dashboard/playground.html", context)


@login_required
@require_POST
def playground_key(request: HttpRequest, slug: str) -> HttpResponse:
    """A short-lived inference key for this browser tab's playground: its requests are
    limited, metered and billed like any other (the key shows in the key list)."""
    access = page_access(request, slug, Perm.KEYS_CREATE)
    user = page_user(request)
    issued = services.api_key_create(
        tenant=access.tenant,
        name=f"playground · {user.get_username()}"[:100],
        scopes=[ApiKey.Scope.INFERENCE],
        created_by=user,
        expires_at=timezone.now() + timedelta(hours=PLAYGROUND_KEY_HOURS),
    )
    response = JsonResponse({"key": issued.secret, "prefix": issued.api_key.display_prefix})
    response["Cache-Control"] = "no-store"
    return response
