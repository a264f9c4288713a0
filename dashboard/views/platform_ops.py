"""The operator's pages (staff only): pools, replicas, routes, prices, new tenants."""

from __future__ import annotations

from datetime import UTC

from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
)
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from billing.selectors import price_list
from billing.services import price_set
from dashboard import forms, selectors
from dashboard.access import page_user
from dashboard.views.common import form_errors
from fleet.models import Pool, Replica
from inference import selectors as inference_selectors
from inference import services as inference_services
from tenants import selectors as tenant_selectors
from tenants import services
from tenants.priority import DEFAULT_CLASS

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
            form_errors(form, exc)
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
            form_errors(form, exc)
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
            form_errors(form, exc)
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
                form_errors(form, exc)
            else:
                return redirect("dashboard:ops-prices")
        status = 400
    context = {"section": "ops", "form": form, "prices": price_list(), "now": timezone.now()}
    return render(request, "dashboard/prices.html", context, status=status)
