"""The playground: a tenant's members try its models with a short-lived key."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.decorators import login_required
from django.http import (
    HttpRequest,
    HttpResponse,
    JsonResponse,
)
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from dashboard import selectors
from dashboard.access import page_access, page_user
from dashboard.views.common import page_context
from tenants import services
from tenants.access import Perm
from tenants.models import ApiKey

# --- Playground ----------------------------------------------------------------------------

PLAYGROUND_KEY_HOURS = 12


@login_required
@require_GET
def playground(request: HttpRequest, slug: str) -> HttpResponse:
    access = page_access(request, slug)
    context = page_context(
        request, access, "playground", models=selectors.playground_models(tenant=access.tenant)
    )
    return render(request, "dashboard/playground.html", context)


@login_required
@require_POST
def playground_key(request: HttpRequest, slug: str) -> HttpResponse:
    """A short-lived inference key for this browser tab's playground: its requests are
    limited, metered and billed like any other (the key shows in the key list)."""
    access = page_access(request, slug, Perm.KEYS_CREATE)
    user = page_user(request)
    issued = services.api_key_create(
        tenant=access.tenant,
        name=f"playground · {user.get_username()}"[:100],
        scopes=[ApiKey.Scope.INFERENCE],
        created_by=user,
        expires_at=timezone.now() + timedelta(hours=PLAYGROUND_KEY_HOURS),
    )
    response = JsonResponse({"key": issued.secret, "prefix": issued.api_key.display_prefix})
    response["Cache-Control"] = "no-store"
    return response
