"""Pieces every control API view shares: error mapping and tenant access checks."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ObjectDoesNotExist
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from drf_spectacular import openapi
from rest_framework import exceptions
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from tenants.access import Perm, TenantAccess
from tenants.models import Tenant, User
from tenants.selectors import tenant_access_get


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Services raise Django's exceptions; answer them in DRF's shape, never as a 500."""
    if isinstance(exc, DjangoValidationError):
        detail: Any
        if hasattr(exc, "message_dict"):
            detail = exc.message_dict
        else:
            detail = {"non_field_errors": exc.messages}
        exc = exceptions.ValidationError(detail=detail)
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(detail=str(exc) or None)
    elif isinstance(exc, ObjectDoesNotExist):
        exc = exceptions.NotFound()
    return drf_exception_handler(exc, context)


def request_user(request: Request) -> User:
    user = request.user
    if not isinstance(user, User):
        raise exceptions.NotAuthenticated()
    return user


def tenant_access(request: Request, slug: str, perm: Perm = Perm.VIEW) -> TenantAccess:
    """The tenant named in the URL, if the caller may ``perm`` in it.

    Not a member → 404 (the tenant's existence is not revealed); member without the
    permission → 403.
    """
    try:
        access = tenant_access_get(user=request_user(request), slug=slug)
    except Tenant.DoesNotExist:
        raise exceptions.NotFound() from None
    if not access.can(perm):
        raise exceptions.PermissionDenied(f"Your role in {slug} does not allow this.")
    return access


class AutoSchema(openapi.AutoSchema):
    """Name nested serializers after their view (``ApiKeyCreateApi.InputSerializer`` →
    ``ApiKeyCreateInput``) so one-view-per-operation never collides in the schema."""

    def _get_serializer_name(
        self, serializer: Any, direction: Any, bypass_extensions: bool = False
    ) -> str:
        name = super()._get_serializer_name(serializer, direction, bypass_extensions)
        cls = serializer if isinstance(serializer, type) else type(serializer)
        outer = cls.__qualname__.split(".")
        if len(outer) > 1:
            return outer[0].removesuffix("Api") + name
        return name


def paginate(
    request: Request, view: APIView, queryset: QuerySet[Any], serializer: type
) -> Response:
    """One page of a list (``limit`` / ``offset``), with DRF's ``count``/``next``/``previous``."""
    paginator = LimitOffsetPagination()
    page = paginator.paginate_queryset(queryset, request, view=view)
    return paginator.get_paginated_response(serializer(page, many=True).data)
