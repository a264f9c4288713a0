"""Brute-force protection on every password login (django-axes, counted in Redis): the
dashboard's ``/app/login/`` and the control API's ``/api/auth/token/``. Failures are counted
per username and per client address; at the limit both answer 429 for the cool-off, the
right password included, while everyone else logs in as usual."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from tests.conftest import TenantPeople

pytestmark = pytest.mark.django_db

RIGHT = "correct horse battery staple"


def _log_in(client: Client, username: str, password: str) -> Any:
    return client.post("/app/login/", {"username": username, "password": password})


def test_repeated_failed_logins_get_a_429_form_error_for_a_cooldown(
    people: TenantPeople, settings: Any
) -> None:
    settings.AXES_FAILURE_LIMIT = 3
    attacker = Client(REMOTE_ADDR="203.0.113.7")
    assert [_log_in(attacker, "owner", "nope").status_code for _ in range(2)] == [200, 200]
    locked = _log_in(attacker, "owner", "nope")
    assert locked.status_code == 429 and locked["Retry-After"] == "900"
    assert b"Too many failed logins" in locked.content and b"15 minutes" in locked.content
    assert b'value="owner"' in locked.content  # still the login form, filled in
    # Locked per username: the right password, from anywhere, waits too.
    elsewhere = Client(REMOTE_ADDR="198.51.100.1")
    assert _log_in(elsewhere, "owner", RIGHT).status_code == 429
    assert elsewhere.get("/app/t/acme/").status_code == 302  # not logged in
    # ...and per address: that address cannot log anyone in either.
    assert _log_in(attacker, "admin", RIGHT).status_code == 429
    # Everyone else is unaffected.
    assert _log_in(Client(REMOTE_ADDR="198.51.100.2"), "admin", RIGHT).status_code == 302


def test_failures_spread_over_usernames_lock_the_address(
    people: TenantPeople, settings: Any
) -> None:
    settings.AXES_FAILURE_LIMIT = 3
    sprayer = Client(REMOTE_ADDR="203.0.113.8")
    statuses = [_log_in(sprayer, name, "guess").status_code for name in ("a", "b", "c")]
    assert statuses == [200, 200, 429]
    assert _log_in(sprayer, "viewer", RIGHT).status_code == 429
    # Failing as a username that looks like an address does not lock that address.
    for _ in range(3):
        _log_in(Client(REMOTE_ADDR="203.0.113.9"), "198.51.100.3", "guess")
    assert _log_in(Client(REMOTE_ADDR="198.51.100.3"), "viewer", RIGHT).status_code == 302


def test_successful_logins_never_count_and_the_lockout_ends(
    people: TenantPeople, settings: Any
) -> None:
    import time
    from datetime import timedelta as td

    settings.AXES_FAILURE_LIMIT = 2
    settings.AXES_COOLOFF_TIME = td(seconds=1)
    for _ in range(5):
        assert _log_in(Client(), "developer", RIGHT).status_code == 302
    _log_in(Client(), "developer", "nope")
    assert _log_in(Client(), "developer", "nope").status_code == 429
    assert _log_in(Client(), "developer", RIGHT).status_code == 429
    time.sleep(1.2)
    assert _log_in(Client(), "developer", RIGHT).status_code == 302


async def test_the_lockout_page_is_served_over_asgi_too(
    people: TenantPeople, settings: Any
) -> None:
    """The live server runs Django's async handler, where axes calls its hook differently."""
    from asgiref.sync import sync_to_async
    from django.db import connections
    from django.test import AsyncClient

    settings.AXES_FAILURE_LIMIT = 1
    client = AsyncClient()
    locked = await client.post("/app/login/", {"username": "finance", "password": "nope"})
    # The view ran in asgiref's worker thread; the test client keeps its connection open.
    await sync_to_async(connections.close_all)()
    assert locked.status_code == 429 and b"Too many failed logins" in locked.content


# --- The control API's token exchange -------------------------------------------------------


def _token(username: str, password: str, address: str = "127.0.0.1") -> Any:
    client = APIClient(REMOTE_ADDR=address)
    basic = base64.b64encode(f"{username}:{password}".encode()).decode()
    client.credentials(HTTP_AUTHORIZATION=f"Basic {basic}")
    return client.post("/api/auth/token/")


def test_repeated_failed_token_requests_get_429_for_a_cooldown(
    people: TenantPeople, settings: Any
) -> None:
    settings.AXES_FAILURE_LIMIT = 3
    address = "203.0.113.20"
    assert [_token("admin", "nope", address).status_code for _ in range(2)] == [401, 401]
    locked = _token("admin", "nope", address)
    assert locked.status_code == 429 and locked["Retry-After"] == "900"
    assert locked.json() == {
        "detail": "Too many failed logins for this username or from this address. "
        "Expected available in 900 seconds."
    }
    # The right password waits too, from anywhere; and that address gets no other token.
    assert _token("admin", RIGHT, "198.51.100.20").status_code == 429
    assert _token("owner", RIGHT, address).status_code == 429
    # Everyone else is unaffected, and successful logins never count.
    for _ in range(5):
        answer = _token("owner", RIGHT, "198.51.100.21")
        assert answer.status_code == 200 and answer.json()["token"]


def test_token_and_dashboard_failures_add_up(people: TenantPeople, settings: Any) -> None:
    """One count per username, whichever door is knocked on."""
    settings.AXES_FAILURE_LIMIT = 3
    _log_in(Client(REMOTE_ADDR="203.0.113.30"), "finance", "nope")
    _token("finance", "nope", "203.0.113.31")
    assert _token("finance", "nope", "203.0.113.32").status_code == 429
    assert _log_in(Client(REMOTE_ADDR="203.0.113.33"), "finance", RIGHT).status_code == 429
