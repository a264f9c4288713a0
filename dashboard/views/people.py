"""A tenant's members and invitations (roles, removal, joining by an invitation's link), and
its audit log."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.contrib.auth import login as auth_login
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db import transaction
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
)
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from dashboard import forms
from dashboard.access import page_access, page_user
from dashboard.views.common import error_message, page_context
from tenants import selectors as tenant_selectors
from tenants import services
from tenants.access import Perm, TenantAccess
from tenants.models import Invitation, Membership, Role

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
    context = page_context(
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
        return _members_page(request, access, error=error_message(exc), status=status)
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
        return _members_page(request, access, error=error_message(exc), status=status)
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
            context["error"] = error_message(exc)
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
    context = page_context(request, access, "audit", form=form, page=page, query=query.urlencode())
    return render(request, "dashboard/audit.html", context, status=status)
