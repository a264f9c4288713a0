"""Brute-force protection for every password login: the dashboard (``/app/login/``), the
control API's token exchange (``/api/auth/token/``) and the Django admin.

django-axes counts failed logins in the cache (Redis) per username and per client address;
once either reaches ``AXES_FAILURE_LIMIT`` within ``AXES_COOLOFF_TIME``, every login for that
username or from that address is refused for the cool-off, the right password included.
This module holds the pieces axes is configured with.
"""

from __future__ import annotations

import math
from typing import Any

from axes.helpers import get_cool_off
from django.contrib.auth.forms import AuthenticationForm
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from rest_framework.exceptions import Throttled


def counted_username(request: HttpRequest, credentials: dict[str, Any] | None) -> str | None:
    """The name failures are counted under.

    axes keys its counters by the bare value, so without a prefix failing ten times as the
    username ``10.0.0.7`` would lock out the address 10.0.0.7.
    """
    if credentials:
        username = credentials.get("username")
    else:
        username = getattr(request, "POST", {}).get("username")
    return None if username is None else f"user:{username}"


def cooloff_seconds(request: HttpRequest | None = None) -> int:
    cool_off = get_cool_off(request)
    return math.ceil(cool_off.total_seconds()) if cool_off else 0


LOCKOUT_REASON = "Too many failed logins for this username or from this address."


def lockout_message(request: HttpRequest | None = None) -> str:
    minutes = max(1, math.ceil(cooloff_seconds(request) / 60))
    return f"{LOCKOUT_REASON} Try again in {minutes} minute{'s' if minutes != 1 else ''}."


def api_lockout_error(request: HttpRequest | None = None) -> Throttled:
    """The control API's answer: DRF's 429, which says how many seconds to wait."""
    return Throttled(wait=cooloff_seconds(request), detail=LOCKOUT_REASON)


def lockout_response(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
    """What a locked-out login gets: 429 with ``Retry-After``, in DRF's error shape under
    ``/api/``, else the login form with the reason as its error.

    (axes passes the original response and the credentials, in an order that differs
    between its sync and async paths; neither is needed here.)
    """
    response: HttpResponse
    if request.path.startswith("/api/"):
        response = JsonResponse({"detail": str(api_lockout_error(request).detail)}, status=429)
    else:
        data = getattr(request, "POST", {})
        # Unbound: validating the posted form would try (and count) one more login.
        form = AuthenticationForm(request, initial={"username": data.get("username", "")})
        context = {"form": form, "next": data.get("next", ""), "lockout": lockout_message(request)}
        response = render(request, "dashboard/login.html", context, status=429)
    response["Retry-After"] = str(cooloff_seconds(request))
    return response
