"""What every dashboard page has: what the tenant's role may do, the layout's context, a
service's refusal shown on its form."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied, ValidationError
from django.http import (
    HttpRequest,
)

from dashboard.access import page_user
from tenants import selectors as tenant_selectors
from tenants.access import Perm, TenantAccess

CHART_DAYS = 30  # the usage chart and the explorer's default window


def can(access: TenantAccess) -> dict[str, bool]:
    """What the templates may offer: ``can.keys_create``, ``can.billing_view``, ..."""
    return {perm.name.lower(): access.can(perm) for perm in Perm}


def page_context(
    request: HttpRequest, access: TenantAccess, section: str, **extra: Any
) -> dict[str, Any]:
    """What every tenant page's layout needs: the tenant, the role, the tenant switcher."""
    return {
        "tenant": access.tenant,
        "access": access,
        "role": access.role or ("staff" if access.is_staff else ""),
        "can": can(access),
        "section": section,
        "tenants": tenant_selectors.tenant_list_for_user(user=page_user(request)).order_by("slug")[
            :50
        ],
        **extra,
    }


def form_errors(form: Any, exc: ValidationError) -> None:
    messages = exc.message_dict if hasattr(exc, "error_dict") else {None: exc.messages}
    for field, errors in messages.items():
        for error in errors:
            form.add_error(field if field in form.fields else None, error)


def error_message(exc: ValidationError | PermissionDenied) -> str:
    if isinstance(exc, ValidationError):
        return " ".join(exc.messages)
    return str(exc)
