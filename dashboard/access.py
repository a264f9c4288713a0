"""Who may see which dashboard page: the same rules as the control API (tenants.access).

A tenant the user does not belong to is a 404, exactly like one that does not exist; a
member without the permission gets 403.
"""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest

from tenants.access import Perm, TenantAccess
from tenants.models import Tenant, User
from tenants.selectors import tenant_access_get


def page_user(request: HttpRequest) -> User:
    user = request.user
    if not isinstance(user, User):  # the views are behind login_required
        raise PermissionDenied
    return user


def page_access(request: HttpRequest, slug: str, perm: Perm = Perm.VIEW) -> TenantAccess:
    try:
        access = tenant_access_get(user=page_user(request), slug=slug)
    except Tenant.DoesNotExist:
        raise Http404("No such tenant.") from None
    if not access.can(perm):
        raise PermissionDenied(f"Your role in {slug} does not allow this.")
    return access
