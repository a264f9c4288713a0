"""A tenant's usage explorer (and its CSV) and invoices."""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
)
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from billing.exports import spreadsheet_safe
from billing.invoicing import invoice_finalize, invoice_void
from billing.models import Invoice
from billing.pricing import micros_to_usd
from billing.selectors import invoice_get, invoice_list
from dashboard import forms, selectors
from dashboard.access import page_access, page_user
from dashboard.views.common import CHART_DAYS, page_context
from tenants import selectors as tenant_selectors
from tenants.access import Perm, TenantAccess
from tenants.keys import KEY_TAG

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
    context = page_context(
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
    context = page_context(
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
    context = page_context(
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
