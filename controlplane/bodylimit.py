"""Request bodies bounded before Django reads them.

Django's ASGI handler reads the whole body of every request (spooling it to a temporary file
past 2.5 MB) before it routes, so without this any URL would accept any size from anyone.
This wraps that handler: a declared ``Content-Length`` over the route's limit is answered 413
at once, and a body that grows past it while streaming (chunked uploads) is cut off there.
The ``/v1`` consumers bound their own bodies (and check the key first); ``/v1/files`` and
``/v1/batches`` are Django's, bounded here.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from django.conf import settings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# Routes that take a LoRA adapter: the API and the dashboard's form.
ADAPTER_UPLOADS = re.compile(r"^/(api/tenants/[^/]+/adapters/upload|app/t/[^/]+/adapters)/$")
# The dashboard's batch input file form (the Files API, ``/v1/files``, checks a key instead).
BATCH_UPLOAD_FORM = re.compile(r"^/app/t/[^/]+/batches/$")
# Uploads by a signed-in user: their sender is checked before the body is read (signedin).
UPLOADS = re.compile(f"{ADAPTER_UPLOADS.pattern}|{BATCH_UPLOAD_FORM.pattern}")
_MULTIPART_SLACK = 1024 * 1024  # the form's other fields and the part headers


class BodyTooLarge(Exception):
    pass


def body_limit(path: str) -> int:
    if ADAPTER_UPLOADS.match(path):
        return int(settings.ADAPTER_MAX_BYTES) + _MULTIPART_SLACK
    if path == "/v1/files" or BATCH_UPLOAD_FORM.match(path):  # a batch input file
        return int(settings.INFERPLANE_FILE_MAX_BYTES) + _MULTIPART_SLACK
    return int(settings.INFERPLANE_MAX_CONTROL_BODY_BYTES)


class BoundedBody:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = body_limit(scope["path"])
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _refuse(scope, send, limit)
                return
        received = 0
        started = False

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _refuse(scope, send, limit)


async def _refuse(scope: Scope, send: Send, limit: int) -> None:
    message = f"Request body too large: the limit here is {limit:,} bytes."
    if scope["path"].startswith("/api/"):
        body, kind = orjson.dumps({"detail": message}), b"application/json"  # DRF's shape
    elif scope["path"].startswith("/v1/"):  # OpenAI's shape
        error = {"message": message, "type": "invalid_request_error", "param": None}
        body = orjson.dumps({"error": {**error, "code": "request_too_large"}})
        kind = b"application/json"
    else:
        body, kind = message.encode(), b"text/plain; charset=utf-8"
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", kind), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body})
