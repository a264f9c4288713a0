"""The Files and Batch APIs check the API key before Django reads a byte of the body.

Django's ASGI handler reads a request's whole body before it routes (spooling it to disk past
2.5 MB), and only then would the view look at the key: anyone could make a web process take
``INFERPLANE_FILE_MAX_BYTES`` of upload, without a key. This wrapper answers 401/403 from the
headers alone, with the same errors the views give, using the gateway's key cache (in
process, then Redis), so a known key costs no query. The views check the key again (cheap);
if the cache cannot answer (Redis or the database away), the request goes on to them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from django.db import DatabaseError
from redis.exceptions import RedisError

from inference.gateway.auth import authenticate
from inference.gateway.errors import ApiError
from tenants.models import ApiKey

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def missing_api_key() -> ApiError:
    return ApiError(
        401,
        "You didn't provide an API key. Send it as `Authorization: Bearer sk-…`.",
        code="missing_api_key",
    )


def bearer(header: str) -> str:
    return header[7:].strip() if header.lower().startswith("bearer ") else ""


class KeyFirst:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = await _key_error(scope)
            if error is not None:
                await _answer(send, error)
                return
        await self.app(scope, receive, send)


async def _key_error(scope: Scope) -> ApiError | None:
    header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    raw = bearer(header.decode("latin-1"))
    if not raw:
        return missing_api_key()
    try:
        await authenticate(raw, scope=ApiKey.Scope.BATCH)
    except ApiError as error:
        return error
    except (RedisError, DatabaseError):
        return None  # the view decides, from the database
    return None


async def _answer(send: Send, error: ApiError) -> None:
    body = error.json()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),  # the body it declared is not read
        *((k.encode(), v.encode()) for k, v in error.headers.items()),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
