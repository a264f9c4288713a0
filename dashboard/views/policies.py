"""A tenant's own controls: moderation policy, response cache, limits and budgets."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db import transaction
from django.http import (
    HttpRequest,
    HttpResponse,
)
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST
from redis.exceptions import RedisError

from batches import quotas as batch_quotas
from dashboard import forms, selectors
from dashboard.access import page_access, page_user
from dashboard.views.common import form_errors, page_context
from inference import services as inference_services
from moderation import selectors as moderation_selectors
from moderation import services as moderation_services
from moderation.categories import CATEGORIES
from moderation.policy import PolicyInvalid
from tenants import services
from tenants.access import Perm

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
    context = page_context(request, access, "moderation", form=form, policy=policy, events=events)
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
                form_errors(form, exc)
            else:
                return redirect("dashboard:cache", slug=slug)
        status = 400
    month = selectors.month_summary(tenant=tenant, today=timezone.now().date())
    context = page_context(
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
                form_errors(form, exc)
            else:
                return redirect("dashboard:limits", slug=slug)
        status = 400
    rows = [(form.fields[name].label, getattr(tenant, name)) for name in form.LIMITS]
    budget = tenant.monthly_spend_budget_micros
    context = page_context(
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
