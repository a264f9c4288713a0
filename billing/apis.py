"""Usage and costs for tenants and finance, in the shape of OpenAI's organization usage and
costs APIs (buckets of results), read from the daily rollups.

Tenant members with billing access (owner, admin, finance) see their tenant's; platform
staff see any tenant's, or every tenant's when they leave ``tenant`` out.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import HttpResponse, StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import exceptions, serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing.exports import invoice_lines_csv, usage_csv_stream
from billing.invoicing import invoice_finalize, invoice_void
from billing.models import Invoice, InvoiceLine
from billing.pricing import micros_to_usd
from billing.selectors import daily_usage_buckets, invoice_get, invoice_list
from controlplane.api import request_user, tenant_access
from tenants.access import Perm
from tenants.keys import KEY_TAG
from tenants.models import Tenant

MAX_DAYS = 31
EPOCH_LIMIT = 4_102_444_800  # 2100-01-01: later times are certainly mistakes


class _QuerySerializer(serializers.Serializer[Any]):
    tenant = serializers.SlugField(required=False)
    start_time = serializers.IntegerField(min_value=0, max_value=EPOCH_LIMIT)
    end_time = serializers.IntegerField(min_value=0, max_value=EPOCH_LIMIT, required=False)
    bucket_width = serializers.ChoiceField(choices=["1d"], default="1d")
    limit = serializers.IntegerField(min_value=1, max_value=MAX_DAYS, default=7)
    page = serializers.IntegerField(min_value=0, max_value=EPOCH_LIMIT, required=False)
    group_by = serializers.CharField(required=False, default="")

    GROUPS: tuple[str, ...] = ()

    def validate_group_by(self, value: str) -> list[str]:
        groups = [g.strip() for g in value.split(",") if g.strip()]
        unknown = [g for g in groups if g not in self.GROUPS]
        if unknown:
            raise serializers.ValidationError(
                f"Unknown group {unknown[0]!r}; choose from {', '.join(self.GROUPS)}."
            )
        return list(dict.fromkeys(groups))

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        end = attrs.get("end_time")
        if end is not None and end <= attrs["start_time"]:
            raise serializers.ValidationError({"end_time": "Must be after start_time."})
        return attrs


def _day(epoch: int) -> date:
    return datetime.fromtimestamp(epoch, tz=UTC).date()


def _epoch(day: date) -> int:
    return int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp())


def _window(
    request: Request, query: type[_QuerySerializer]
) -> tuple[Tenant | None, date, int, dict[str, Any]]:
    """Parse the query and check access: (tenant or None for all, first day, days, params)."""
    params = query(data=request.query_params)
    params.is_valid(raise_exception=True)
    data = params.validated_data
    slug = data.get("tenant")
    if slug:
        tenant: Tenant | None = tenant_access(request, slug, Perm.BILLING_VIEW).tenant
    elif request_user(request).is_staff:
        tenant = None
    else:
        raise exceptions.ValidationError({"tenant": ["This field is required."]})
    first = _day(data.get("page") or data["start_time"])
    # The window ends at end_time (exclusive) or now; a partial last day counts as a day.
    end_epoch = data.get("end_time") or int(datetime.now(UTC).timestamp()) + 1
    last = _day(end_epoch - 1)
    days = max(0, min((last - first).days + 1, data["limit"]))
    return tenant, first, days, {**data, "last": last}


def _page(buckets: list[dict[str, Any]], first: date, days: int, last: date) -> dict[str, Any]:
    after = first + timedelta(days=days)
    more = days > 0 and after <= last
    return {
        "object": "page",
        "data": buckets,
        "has_more": more,
        "next_page": str(_epoch(after)) if more else None,
    }


def _bucket(day: date, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "bucket",
        "start_time": _epoch(day),
        "end_time": _epoch(day + timedelta(days=1)),
        "results": results,
    }


def _window_parameters(group_by: str) -> list[OpenApiParameter]:
    return [
        OpenApiParameter("tenant", str, description="Tenant slug (staff: omit for all)."),
        OpenApiParameter("start_time", int, required=True, description="Unix seconds."),
        OpenApiParameter("end_time", int, description="Unix seconds, exclusive."),
        OpenApiParameter("bucket_width", str, description="1d (UTC days)."),
        OpenApiParameter("group_by", str, description=group_by),
        OpenApiParameter("limit", int, description="Buckets per page, 1-31 (default 7)."),
        OpenApiParameter("page", int, description="next_page from the previous answer."),
    ]


class UsageApi(APIView):
    class QuerySerializer(_QuerySerializer):
        GROUPS = ("model", "api_key", "mode", "adapter", "priority")

    @extend_schema(
        parameters=_window_parameters("Comma list: model, api_key, mode, adapter, priority."),
        responses=dict,
    )
    def get(self, request: Request) -> Response:
        tenant, first, days, data = _window(request, self.QuerySerializer)
        groups: list[str] = data["group_by"]
        buckets = []
        for day, rows in daily_usage_buckets(
            tenant=tenant, start=first, days=days, group_by=groups
        ):
            results = [
                {
                    "object": "organization.usage.completions.result",
                    "input_tokens": row["prompt_tokens"],
                    "output_tokens": row["completion_tokens"],
                    "input_cached_tokens": row["cached_tokens"],
                    "num_model_requests": row["requests"],
                    "num_errors": row["errors"],
                    # Ours: the requests answered from the tenant's response cache.
                    "num_cache_hits": row["cache_hits"],
                    "model": row["model"] if "model" in groups else None,
                    "api_key_id": (
                        (f"{KEY_TAG}{row['api_key__prefix']}" if row["api_key__prefix"] else "")
                        if "api_key" in groups
                        else None
                    ),
                    "batch": (row["mode"] == "batch") if "mode" in groups else None,
                    # Ours, not OpenAI's: the LoRA adapter (``name:version``; "" for the base).
                    "adapter": row["adapter"] if "adapter" in groups else None,
                    # Ours: the priority class (interactive, standard, background).
                    "priority": row["priority"] if "priority" in groups else None,
                }
                for row in rows
            ]
            buckets.append(_bucket(day, results))
        return Response(_page(buckets, first, days, data["last"]))


class CostsApi(APIView):
    class QuerySerializer(_QuerySerializer):
        GROUPS = ("line_item",)

    @extend_schema(parameters=_window_parameters("line_item (model and mode)."), responses=dict)
    def get(self, request: Request) -> Response:
        tenant, first, days, data = _window(request, self.QuerySerializer)
        by_item = "line_item" in data["group_by"]
        buckets = []
        for day, rows in daily_usage_buckets(
            tenant=tenant, start=first, days=days, group_by=["model", "mode"] if by_item else []
        ):
            results = [
                {
                    "object": "organization.costs.result",
                    # Money is never a float here: an exact decimal string in dollars.
                    "amount": {"value": micros_to_usd(row["cost_micros"] or 0), "currency": "usd"},
                    "line_item": f"{row['model']}, {row['mode']}" if by_item else None,
                    "unpriced_requests": row["unpriced"],
                }
                for row in rows
            ]
            buckets.append(_bucket(day, results))
        return Response(_page(buckets, first, days, data["last"]))


# --- Invoices and exports (per tenant) --------------------------------------------------------


class InvoiceLineOutputSerializer(serializers.Serializer[Any]):
    model = serializers.CharField()
    mode = serializers.CharField()
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    cost_usd = serializers.SerializerMethodField()
    amount_cents = serializers.IntegerField()
    unpriced_requests = serializers.IntegerField(source="unpriced")

    def get_cost_usd(self, line: InvoiceLine) -> str:
        return micros_to_usd(line.cost_micros)


class InvoiceOutputSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    period = serializers.SerializerMethodField()
    status = serializers.CharField()
    currency = serializers.CharField()
    total_cents = serializers.IntegerField()
    refunded_cents = serializers.IntegerField()
    disputed = serializers.BooleanField()
    finalized_at = serializers.DateTimeField()
    paid_at = serializers.DateTimeField()
    payment_failed_at = serializers.DateTimeField()
    stripe_invoice_id = serializers.CharField()
    stripe_hosted_url = serializers.CharField()

    def get_period(self, invoice: Invoice) -> str:
        return f"{invoice.period_start:%Y-%m}"


class InvoiceDetailOutputSerializer(InvoiceOutputSerializer):
    lines = InvoiceLineOutputSerializer(many=True)


def _invoice(access_tenant: Tenant, invoice_id: int) -> Invoice:
    try:
        return invoice_get(tenant=access_tenant, invoice_id=invoice_id)
    except Invoice.DoesNotExist:
        raise exceptions.NotFound() from None


class InvoiceListApi(APIView):
    @extend_schema(responses=InvoiceOutputSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.BILLING_VIEW)
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(invoice_list(tenant=access.tenant), request, view=self)
        return paginator.get_paginated_response(InvoiceOutputSerializer(page, many=True).data)


class InvoiceDetailApi(APIView):
    @extend_schema(responses=InvoiceDetailOutputSerializer)
    def get(self, request: Request, slug: str, invoice_id: int) -> Response:
        access = tenant_access(request, slug, Perm.BILLING_VIEW)
        return Response(InvoiceDetailOutputSerializer(_invoice(access.tenant, invoice_id)).data)


class InvoiceLinesCsvApi(APIView):
    @extend_schema(responses={(200, "text/csv"): str})
    def get(self, request: Request, slug: str, invoice_id: int) -> HttpResponse:
        access = tenant_access(request, slug, Perm.BILLING_VIEW)
        invoice = _invoice(access.tenant, invoice_id)
        response = HttpResponse(
            invoice_lines_csv(invoice.lines.select_related("invoice"), access.tenant.slug),
            content_type="text/csv",
        )
        name = f"{access.tenant.slug}-invoice-{invoice.period_start:%Y-%m}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response


class InvoiceFinalizeApi(APIView):
    class InputSerializer(serializers.Serializer[Any]):
        period = serializers.RegexField(
            r"^\d{4}-(0[1-9]|1[0-2])$",
            help_text="YYYY-MM",
            error_messages={"invalid": "A month like 2026-11."},
        )

        def validate_period(self, value: str) -> str:
            if not 2000 <= int(value[:4]) <= 9998:
                raise serializers.ValidationError("Choose a month between 2000 and 9998.")
            return value

    @extend_schema(request=InputSerializer, responses=InvoiceDetailOutputSerializer)
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.PLATFORM)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        year, month = (int(x) for x in data.validated_data["period"].split("-"))
        try:
            invoice = invoice_finalize(
                tenant=access.tenant,
                period_start=date(year, month, 1),
                actor=request_user(request),
            )
        except DjangoValidationError as exc:
            raise exceptions.ValidationError(exc.message_dict) from None
        invoice = _invoice(access.tenant, invoice.pk)
        return Response(InvoiceDetailOutputSerializer(invoice).data)


class InvoiceVoidApi(APIView):
    @extend_schema(request=None, responses=InvoiceOutputSerializer)
    def post(self, request: Request, slug: str, invoice_id: int) -> Response:
        access = tenant_access(request, slug, Perm.PLATFORM)
        invoice = _invoice(access.tenant, invoice_id)
        try:
            invoice = invoice_void(invoice=invoice, actor=request_user(request))
        except DjangoValidationError as exc:
            raise exceptions.ValidationError(exc.message_dict) from None
        return Response(InvoiceOutputSerializer(invoice).data)


class UsageExportApi(APIView):
    """The usage detail as CSV, streamed page by page: any size, flat memory."""

    class QuerySerializer(serializers.Serializer[Any]):
        start = serializers.DateField(help_text="First day (UTC), YYYY-MM-DD.")
        end = serializers.DateField(help_text="Last day (UTC), included.")

        def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
            if attrs["end"] < attrs["start"]:
                raise serializers.ValidationError({"end": "Is before start."})
            if attrs["end"] >= date(9999, 12, 31):
                raise serializers.ValidationError({"end": "Must be before 9999-12-31."})
            return attrs

    @extend_schema(
        parameters=[
            OpenApiParameter("start", str, required=True, description="YYYY-MM-DD (UTC)."),
            OpenApiParameter("end", str, required=True, description="YYYY-MM-DD, included."),
        ],
        responses={(200, "text/csv"): str},
    )
    def get(self, request: Request, slug: str) -> StreamingHttpResponse:
        access = tenant_access(request, slug, Perm.BILLING_VIEW)
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        start, end = query.validated_data["start"], query.validated_data["end"]
        response = StreamingHttpResponse(
            usage_csv_stream(
                tenant=access.tenant,
                start=datetime.combine(start, time.min, tzinfo=UTC),
                end=datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC),
            ),
            content_type="text/csv",
        )
        name = f"{access.tenant.slug}-usage-{start}-{end}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
