"""``/v1/files`` and ``/v1/batches``: OpenAI's Files and Batch APIs, as the official SDKs call
them. Served by Django (not the hot path's consumers): an upload is spooled to a temporary
file as it arrives and never held whole in memory. Authenticated by API key; every error in
OpenAI's shape."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import orjson
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from batches import files as file_services
from batches import selectors, services, wire
from batches.asgi import bearer, missing_api_key
from batches.models import Batch, File
from inference.gateway.errors import ApiError, invalid_api_key, invalid_request
from tenants.models import ApiKey
from tenants.selectors import api_key_authenticate

View = Callable[..., HttpResponseBase]


def _error(error: ApiError) -> JsonResponse:
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def _not_allowed(request: HttpRequest) -> ApiError:
    return ApiError(405, f"Method {request.method} is not allowed here.", code="method_not_allowed")


def v1(methods: set[str]) -> Callable[[Callable[..., HttpResponseBase]], View]:
    """The API key checked (401 otherwise) and its ``batch`` scope (403), the method checked,
    ApiError answered."""

    def wrap(view: Callable[..., HttpResponseBase]) -> View:
        @csrf_exempt
        @functools.wraps(view)
        def call(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            raw = bearer(request.headers.get("Authorization", ""))
            key = api_key_authenticate(raw_key=raw) if raw else None
            try:
                if key is None:
                    if not raw:
                        raise missing_api_key()
                    raise invalid_api_key(raw)
                if ApiKey.Scope.BATCH not in key.scopes:
                    raise ApiError(
                        403,
                        "This API key does not have the 'batch' scope.",
                        type="permission_error",
                        code="insufficient_scope",
                    )
                if request.method not in methods:
                    raise _not_allowed(request)
                return view(request, key, *args, **kwargs)
            except ApiError as error:
                return _error(error)

        return call

    return wrap


def _limit(request: HttpRequest, default: int, most: int) -> int:
    raw = request.GET.get("limit")
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid_request("`limit` must be an integer.", param="limit") from None
    if not 1 <= value <= most:
        raise invalid_request(f"`limit` must be between 1 and {most}.", param="limit")
    return value


def _page[T: (File, Batch)](
    items: QuerySet[T], request: HttpRequest, *, default: int, most: int
) -> tuple[list[T], bool]:
    """A cursor page: the ``limit`` items after the id ``after`` (in the list's order)."""
    limit = _limit(request, default, most)
    after = request.GET.get("after")
    if after:
        anchor = items.filter(pk=after).first()
        if anchor is None:
            raise invalid_request(f"No such object: {after}", param="after")
        if items.query.order_by and str(items.query.order_by[0]).startswith("-"):
            items = items.filter(created_at__lte=anchor.created_at).exclude(
                created_at=anchor.created_at, pk__gte=anchor.pk
            )
        else:
            items = items.filter(created_at__gte=anchor.created_at).exclude(
                created_at=anchor.created_at, pk__lte=anchor.pk
            )
    page = list(items[: limit + 1])
    return page[:limit], len(page) > limit


# --- files -----------------------------------------------------------------------------------


@v1({"GET", "POST"})
def files(request: HttpRequest, key: ApiKey) -> HttpResponse:
    if request.method == "POST":
        upload = request.FILES.get("file")
        if upload is None:
            raise invalid_request("Send the file as the multipart field `file`.", param="file")
        purpose = request.POST.get("purpose", "")
        expires = _expires_after(request)
        row = file_services.file_upload(
            tenant=key.tenant, upload=upload, purpose=purpose, expires_after_seconds=expires
        )
        return JsonResponse(row.to_openai())
    order = request.GET.get("order", "desc")
    if order not in {"asc", "desc"}:
        raise invalid_request("`order` is `asc` or `desc`.", param="order")
    items = file_services.file_list(tenant=key.tenant, purpose=request.GET.get("purpose"))
    items = (
        items.order_by("created_at", "pk")
        if order == "asc"
        else items.order_by("-created_at", "-pk")
    )
    page, more = _page(items, request, default=10_000, most=10_000)
    return JsonResponse(
        {
            "object": "list",
            "data": [f.to_openai() for f in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": more,
        }
    )


def _expires_after(request: HttpRequest) -> int | None:
    anchor = request.POST.get("expires_after[anchor]")
    seconds = request.POST.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise invalid_request(
            "`expires_after[anchor]` is `created_at`.", param="expires_after[anchor]"
        )
    try:
        value = int(seconds or "")
    except ValueError:
        raise invalid_request(
            "`expires_after[seconds]` is an integer.", param="expires_after[seconds]"
        ) from None
    if not 3600 <= value <= 2_592_000:
        raise invalid_request(
            "`expires_after[seconds]` is between 3600 (1 hour) and 2592000 (30 days).",
            param="expires_after[seconds]",
        )
    return value


@v1({"GET", "DELETE"})
def file_detail(request: HttpRequest, key: ApiKey, file_id: str) -> HttpResponse:
    row = file_services.file_get(tenant=key.tenant, file_id=file_id)
    if request.method == "DELETE":
        file_services.file_delete(file=row)
        return JsonResponse({"id": row.id, "object": "file", "deleted": True})
    return JsonResponse(row.to_openai())


@v1({"GET"})
def file_content(request: HttpRequest, key: ApiKey, file_id: str) -> HttpResponseBase:
    row = file_services.file_get(tenant=key.tenant, file_id=file_id)
    return file_services.file_download(file=row)


# --- batches ---------------------------------------------------------------------------------


@v1({"GET", "POST"})
def batches(request: HttpRequest, key: ApiKey) -> HttpResponse:
    if request.method == "POST":
        try:
            params = orjson.loads(request.body or b"{}")
        except orjson.JSONDecodeError:
            raise invalid_request("The body is not valid JSON.") from None
        if not isinstance(params, dict):
            raise invalid_request("The body is a JSON object.")
        batch, _ = services.batch_create(
            api_key=key,
            params=params,
            idempotency_key=request.headers.get("Idempotency-Key") or None,
        )
        return JsonResponse(wire.batch_object(batch))
    page, more = _page(selectors.batch_list(tenant=key.tenant), request, default=20, most=100)
    return JsonResponse(
        {
            "object": "list",
            "data": [wire.batch_object(b) for b in page],
            **({"first_id": page[0].id, "last_id": page[-1].id} if page else {}),
            "has_more": more,
        }
    )


@v1({"GET"})
def batch_detail(request: HttpRequest, key: ApiKey, batch_id: str) -> HttpResponse:
    return JsonResponse(
        wire.batch_object(selectors.batch_get(tenant=key.tenant, batch_id=batch_id))
    )


@v1({"POST"})
def batch_cancel(request: HttpRequest, key: ApiKey, batch_id: str) -> HttpResponse:
    batch = selectors.batch_get(tenant=key.tenant, batch_id=batch_id)
    return JsonResponse(wire.batch_object(services.batch_cancel(batch=batch)))
