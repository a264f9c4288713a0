"""An upload (a LoRA adapter; a batch file sent from the dashboard) no one signed in sends is
refused from its headers, before a byte of its body is read: Django reads a request's whole
body before the view checks the token or the session, so anyone could make a web process take
an adapter's 256 MB. Driven through the ASGI application the web processes run, sending
headers only: an answer that waited for the body would never come."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asgiref.testing import ApplicationCommunicator
from django.test import Client
from knox.models import AuthToken

from controlplane.asgi import application
from tests.conftest import TenantPeople

pytestmark = pytest.mark.django_db(transaction=True)

API = "/api/tenants/acme/adapters/upload/"
DASHBOARD = "/app/t/acme/adapters/"
BATCH_FORM = "/app/t/acme/batches/"  # the dashboard's batch file, as big as /v1/files takes


def _post(
    path: str, *headers: tuple[bytes, bytes], body: bytes | None = None, method: str = "POST"
) -> dict[str, Any]:
    """Send the headers of a 200 MB upload; the body only when given (then all of it)."""
    length = len(body) if body is not None else 200_000_000
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 40000),
        "headers": [
            (b"host", b"localhost"),
            (b"content-type", b"multipart/form-data; boundary=x"),
            (b"content-length", str(length).encode()),
            *headers,
        ],
    }

    async def post() -> dict[str, Any]:
        communicator = ApplicationCommunicator(application, scope)
        if body is not None:
            await communicator.send_input({"type": "http.request", "body": body})
        start = await communicator.receive_output(timeout=20)
        answer = await communicator.receive_output(timeout=20)
        await communicator.wait(timeout=5)
        return {"status": start["status"], "headers": dict(start["headers"]), **answer}

    return asyncio.run(post())


@pytest.mark.parametrize(
    ("headers", "detail"),
    [
        ((), "Authentication credentials were not provided."),
        (((b"authorization", b"Token 0123456789abcdef0123"),), "Invalid token."),
        (((b"cookie", b"sessionid=forged"),), "Authentication credentials were not provided."),
        (((b"authorization", b"Token \xff\xfe"),), "Invalid token."),
        (((b"authorization", b"Token"),), "Invalid token header. No credentials provided."),
    ],
)
def test_the_api_refuses_an_upload_no_one_signed_in_sends(
    people: TenantPeople, headers: tuple[tuple[bytes, bytes], ...], detail: str
) -> None:
    answer = _post(API, *headers)
    assert answer["status"] == 401
    assert answer["body"] == b'{"detail":"' + detail.encode() + b'"}'  # DRF's shape
    assert answer["headers"][b"www-authenticate"] == b"Token"


@pytest.mark.parametrize("cookie", [b"", b"sessionid=forged", b"sessionid"])
@pytest.mark.parametrize("form", [DASHBOARD, BATCH_FORM])
def test_the_dashboard_sends_an_upload_no_one_signed_in_sends_to_sign_in(
    people: TenantPeople, cookie: bytes, form: str
) -> None:
    answer = _post(form, *([(b"cookie", cookie)] if cookie else []))
    assert answer["status"] == 302
    assert answer["headers"][b"location"] == f"/app/login/?next={form}".encode()


def test_an_upload_sent_with_another_method_is_checked_too(people: TenantPeople) -> None:
    """Django reads the body of a GET or a PUT that declares one: checked the same way."""
    for method in ("GET", "PUT", "OPTIONS"):
        assert _post(API, method=method)["status"] == 401
        assert _post(DASHBOARD, method=method)["status"] == 302


def test_a_signed_in_upload_reaches_the_view(people: TenantPeople) -> None:
    """A token or a session that holds goes on to Django, whose view answers (here: a form
    with no file in it)."""
    _, token = AuthToken.objects.create(people.admin)
    answer = _post(API, (b"authorization", f"Token {token}".encode()), body=b"--x--\r\n")
    assert answer["status"] == 400, answer
    browser = Client()
    browser.force_login(people.admin)
    session = browser.cookies["sessionid"].value
    # Behind a malformed cookie of another site's, and in a second Cookie header.
    answer = _post(
        DASHBOARD,
        (b"cookie", b'other="{"a":1}"x; theme=dark mode'),
        (b"cookie", f"sessionid={session}".encode()),
        body=b"--x--\r\n",
    )
    assert answer["status"] == 403  # signed in: Django's CSRF check, which the form passes
