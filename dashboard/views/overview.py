"""The dashboard's start: the user's tenants, and a tenant's overview (its tiles and the
usage chart)."""

from __future__ import annotations

from datetime import date, timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import (
    HttpRequest,
    HttpResponse,
)
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET

from dashboard import selectors
from dashboard.access import page_access, page_user
from dashboard.views.common import CHART_DAYS, page_context
from tenants import selectors as tenant_selectors
from tenants.access import Perm
from tenants.models import Tenant


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
    context = page_context(
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
