"""Uploads (LoRA adapters; the dashboard's batch files) check who sends them before Django
reads a byte of the body.

Django's ASGI handler reads a request's whole body (spooling it to disk past 2.5 MB) before
the view looks at the session or the token: anyone could make a web process take
``ADAPTER_MAX_BYTES`` (or a batch file's ``INFERPLANE_FILE_MAX_BYTES``) of upload without
signing in. This wrapper answers from the headers alone, as the views would: the control API
(``/api/tenants/<slug>/adapters/upload/``) a 401 in DRF's shape, the dashboard's forms
(``/app/t/<slug>/adapters/``, ``/app/t/<slug>/batches/``) a redirect to the sign-in page. It
authenticates the way the view will (a knox token in ``Authorization: Token …``, else a
session cookie naming an active user), reading only; the view checks the rest (the session's
hash, whether the user may upload for that tenant) once the body is in. Any request to those
paths that carries a body is checked, whatever its method. If the database cannot answer, the
request goes on to the view.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from importlib import import_module
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import orjson
from django.conf import settings
from django.contrib.auth import SESSION_KEY
from django.db import Error as DjangoDatabaseError  # InterfaceError too
from django.http.cookie import parse_cookie
from knox.auth import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed

from controlplane.bodylimit import UPLOADS
from inference.gateway.db import run_db
from tenants.models import User

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

NOT_SIGNED_IN = "Authentication credentials were not provided."  # DRF's words


class SignedInFirst:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and UPLOADS.match(scope["path"]) and _has_body(scope):
            try:
                refusal = await run_db(_refusal, scope["headers"])
            except Exception:  # the view authenticates in any case: it decides then
                log.exception("the upload's sender could not be checked before its body")
                refusal = None
            if refusal is not None:
                await _answer(scope, send, refusal)
                return
        await self.app(scope, receive, send)


def _has_body(scope: Scope) -> bool:
    """Whatever the method: Django reads the body of a GET that declares one, too."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


def _refusal(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why the request is not signed in (DRF's words), or None when it is or when the
    database cannot say. Reads only: nothing about the session is changed."""
    authorization = b"".join(v for k, v in headers if k == b"authorization")
    # knox's own parsing of the header (``Token <key>``), as the API's authentication does.
    request = SimpleNamespace(headers={"authorization": authorization.decode("latin-1")})
    try:
        if TokenAuthentication().authenticate(request) is not None:
            return None
    except AuthenticationFailed as exc:
        return str(exc.detail)
    except UnicodeDecodeError:
        return "Invalid token."
    except DjangoDatabaseError:
        return None
    cookie = "; ".join(v.decode("latin-1") for k, v in headers if k == b"cookie")
    session_key = parse_cookie(cookie).get(settings.SESSION_COOKIE_NAME)
    if not session_key:
        return NOT_SIGNED_IN
    try:
        store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
        user_id = store.get(SESSION_KEY)
        active = user_id is not None and User.objects.filter(pk=user_id, is_active=True).exists()
    except (DjangoDatabaseError, ValueError):
        return None
    # A session that names an active user goes on: the view checks the rest (its hash).
    return None if active else NOT_SIGNED_IN


async def _answer(scope: Scope, send: Send, detail: str) -> None:
    path = scope["path"]
    if path.startswith("/api/"):
        status = 401
        headers = [
            (b"content-type", b"application/json"),
            (b"www-authenticate", b"Token"),
        ]
        body = orjson.dumps({"detail": detail})
    else:  # the dashboard: to the sign-in page, and back here after it
        status = 302
        location = f"{settings.LOGIN_URL}?next={quote(path)}"
        headers = [(b"location", location.encode()), (b"content-type", b"text/plain")]
        body = b""
    headers += [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
