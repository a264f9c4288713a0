"""The operator page's WebSocket (``/app/ws/ops``) through the real ASGI application: staff
only, and only for as long as the session and the staff rights last."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from django.contrib.sessions.models import Session
from django.test import Client

from dashboard import consumers
from tenants.models import User
from tests.conftest import TenantPeople

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _no_persistent_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer and these helpers touch the database from worker threads, each closing
    its connection when done, as a request would; kept for 60 s (the setting), they would
    hold the test database open past its teardown."""
    from django.db import connection

    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)


def _session_cookie(user: User) -> tuple[Client, str]:
    client = Client()
    client.force_login(user)
    return client, client.cookies["sessionid"].value


async def _connect(session_key: str) -> tuple[ApplicationCommunicator, dict[str, Any]]:
    """Open the socket as the browser does (same-origin, with the session cookie); the
    server's answer: ``websocket.accept`` or ``websocket.close``."""
    # channels.testing's communicator needs daphne; asgiref's is the same thing underneath.
    from controlplane.asgi import application

    scope = {
        "type": "websocket",
        "path": "/app/ws/ops",
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"origin", b"http://testserver"),
            (b"cookie", f"sessionid={session_key}".encode()),
        ],
        "subprotocols": [],
    }
    communicator = ApplicationCommunicator(application, scope)
    await communicator.send_input({"type": "websocket.connect"})
    return communicator, await communicator.receive_output(timeout=5)


async def _closed_with(communicator: ApplicationCommunicator) -> int:
    """The close code the server sends next (within 5 s), skipping table pushes."""
    while True:
        message = await communicator.receive_output(timeout=5)
        if message["type"] == "websocket.close":
            return int(message.get("code", 1000))


def _take_staff_away(user: User, client: Client, key: str) -> None:
    User.objects.filter(pk=user.pk).update(is_staff=False)


def _deactivate(user: User, client: Client, key: str) -> None:
    User.objects.filter(pk=user.pk).update(is_active=False)


def _log_out_elsewhere(user: User, client: Client, key: str) -> None:
    assert client.post("/app/logout/").status_code == 302


def _flush_session(user: User, client: Client, key: str) -> None:
    Session.objects.filter(session_key=key).delete()


def _change_password(user: User, client: Client, key: str) -> None:
    user.set_password("a brand new password")
    user.save()


def _delete_user(user: User, client: Client, key: str) -> None:
    User.objects.filter(pk=user.pk).delete()


@pytest.mark.parametrize(
    "change",
    [
        _take_staff_away,
        _deactivate,
        _log_out_elsewhere,
        _flush_session,
        _change_password,
        _delete_user,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
async def test_a_staff_socket_is_closed_once_staff_rights_or_the_session_end(
    people: TenantPeople, monkeypatch: pytest.MonkeyPatch, change: Callable[..., Any]
) -> None:
    monkeypatch.setattr(consumers, "PUSH_SECONDS", 0.05)
    client, key = await database_sync_to_async(_session_cookie)(people.staff)
    communicator, answer = await _connect(key)
    assert answer["type"] == "websocket.accept"
    first = await communicator.receive_output(timeout=5)
    assert first["text"].startswith('<div id="ops-live"')

    await database_sync_to_async(change)(people.staff, client, key)
    assert await _closed_with(communicator) == 4403
    await communicator.send_input({"type": "websocket.disconnect", "code": 4403})
    await communicator.wait(timeout=5)


async def test_a_staff_socket_stays_open_while_nothing_changes(
    people: TenantPeople, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(consumers, "PUSH_SECONDS", 0.05)
    _, key = await database_sync_to_async(_session_cookie)(people.staff)
    communicator, answer = await _connect(key)
    assert answer["type"] == "websocket.accept"
    assert (await communicator.receive_output(timeout=5))["text"].startswith('<div id="ops-live"')
    assert await communicator.receive_nothing(timeout=0.5)  # many ticks: still open, quiet
    await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
    await communicator.wait(timeout=5)


async def test_a_tenant_owner_is_refused_at_connect(people: TenantPeople) -> None:
    _, key = await database_sync_to_async(_session_cookie)(people.owner)
    _, answer = await _connect(key)
    assert answer["type"] == "websocket.close" and answer["code"] == 4403
