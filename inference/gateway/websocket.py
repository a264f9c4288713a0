"""``/v1/ws``: the gateway over one WebSocket (routed in ``controlplane.asgi``). A client
sends requests as JSON messages and gets each one's chunks, tagged with its id, as they come;
requests on one socket run side by side, each its own ``Lifecycle``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import DatabaseError
from redis.exceptions import RedisError

from controlplane.logs import request_id_new
from inference.gateway import metrics
from inference.gateway.auth import authenticate, bearer_token
from inference.gateway.call import MidStreamError
from inference.gateway.errors import ApiError, overloaded
from inference.gateway.headless import embedder
from inference.gateway.lifecycle import ClientGone, Lifecycle

log = logging.getLogger(__name__)


class GatewayWebSocketConsumer(AsyncWebsocketConsumer):
    """``/v1/ws``: the same requests and chunks over one socket (protocol in docs/api.md).

    Authenticate with ``Authorization: Bearer`` on the upgrade request, or with a first
    message ``{"type": "auth", "api_key": "sk-ip-…"}`` (browsers cannot set headers).
    Then send ``{"type": "request", "id": "…", "endpoint": "chat.completions" |
    "completions", "body": {…}}``; chunks come back as ``{"type": "chunk", "id", "data"}``,
    ending with ``{"type": "done", "id", "usage"}`` or ``{"type": "error", "id", "error"}``.
    ``{"type": "cancel", "id"}`` stops one request. Several requests may run at once.
    """

    channel_layer_alias = "__none__"

    async def connect(self) -> None:
        self.authorization = ""
        self.closed = False
        self.running: dict[str, asyncio.Task[None]] = {}
        self.auth_timer: asyncio.Task[None] | None = None
        for key, value in self.scope["headers"]:
            if key == b"authorization":
                try:
                    self.authorization = bearer_token(bytes(value))
                    await authenticate(self.authorization)
                except ApiError as error:
                    metrics.request_refused(error, endpoint="ws", tenant_slug=None)
                    await self.accept()
                    await self.send_json(
                        {"type": "error", "id": None, "error": error.body()["error"]}
                    )
                    await self.close(code=4401)
                    return
        await self.accept()
        if not self.authorization:
            self.auth_timer = asyncio.create_task(self.close_unless_authenticated())

    async def close_unless_authenticated(self) -> None:
        """A socket that has not authenticated in time is closed: idle anonymous sockets
        would otherwise hold a server's connections (and memory) for ever."""
        timeout = settings.INFERPLANE_WS_AUTH_TIMEOUT_SECONDS
        await asyncio.sleep(timeout)
        if not self.authorization and not self.closed:  # set only by a successful check
            error = ApiError(
                401, f"Not authenticated within {timeout} s; closing.", code="invalid_api_key"
            )
            with contextlib.suppress(ClientGone):
                await self.send_json({"type": "error", "id": None, "error": error.body()["error"]})
            await self.close(code=4401)

    async def disconnect(self, code: int) -> None:
        self.closed = True
        if self.auth_timer is not None:
            self.auth_timer.cancel()
        for task in self.running.values():
            task.cancel()
        for task in list(self.running.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def send_json(self, data: dict[str, Any]) -> None:
        if self.closed:
            raise ClientGone()
        try:
            await self.send(text_data=orjson.dumps(data).decode())
        except (RuntimeError, OSError) as exc:  # the socket closed under us
            raise ClientGone() from exc

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if len(text_data or bytes_data or b"") > settings.INFERPLANE_MAX_BODY_BYTES:
            error = ApiError(
                413,
                f"Message too large: the limit is {settings.INFERPLANE_MAX_BODY_BYTES} bytes.",
                code="request_too_large",
            )
            await self.send_json({"type": "error", "id": None, "error": error.body()["error"]})
            await self.close(code=1009)
            return
        try:
            message = orjson.loads(text_data or bytes_data or b"")
            if not isinstance(message, dict):
                raise ValueError
        except ValueError:
            await self.send_json(
                {
                    "type": "error",
                    "id": None,
                    "error": {
                        "message": "Messages must be JSON objects.",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    },
                }
            )
            return
        kind, rid = message.get("type"), message.get("id")
        if kind == "auth":
            presented = str(message.get("api_key") or "")
            try:
                await authenticate(presented)
            except (ApiError, RedisError, DatabaseError) as exc:
                error = exc if isinstance(exc, ApiError) else overloaded(1)
                await self.send_json({"type": "error", "id": None, "error": error.body()["error"]})
                return
            self.authorization = presented  # only once it is known good
            await self.send_json({"type": "authenticated"})
        elif kind == "cancel" and rid in self.running:
            self.running[rid].cancel()
        elif kind == "request" and isinstance(rid, str) and rid not in self.running:
            self.running[rid] = asyncio.create_task(self.run(rid, message))
        else:
            await self.send_json(
                {
                    "type": "error",
                    "id": rid,
                    "error": {
                        "message": "Expected a message of type auth, request (with a new "
                        "string id) or cancel.",
                        "type": "invalid_request_error",
                        "param": "type",
                        "code": None,
                    },
                }
            )

    async def run(self, rid: str, message: dict[str, Any]) -> None:
        started = time.perf_counter()
        request_id = request_id_new()  # this task's: every line it logs carries it
        # The key once checked, and whether a call was made (then it is counted when settled).
        seen: dict[str, Any] = {}
        endpoint = message.get("endpoint", "chat.completions")
        try:
            if endpoint not in ("chat.completions", "completions"):
                endpoint = "ws"
                raise ApiError(
                    400, "endpoint must be chat.completions or completions", param="endpoint"
                )
            if not self.authorization:
                raise ApiError(401, "Authenticate first.", code="invalid_api_key")
            await self.run_call(rid, endpoint, message.get("body"), started, request_id, seen)
        except (ApiError, RedisError, DatabaseError) as exc:
            error = (
                exc
                if isinstance(exc, ApiError)
                else overloaded(1, "The service is briefly unavailable. Retry in a moment.")
            )
            if not seen.get("ran"):
                key = seen.get("key")
                metrics.request_refused(
                    error, endpoint=endpoint, tenant_slug=key.tenant_slug if key else None
                )
            await self.send_json({"type": "error", "id": rid, "error": error.body()["error"]})
        except ClientGone:
            pass
        finally:
            self.running.pop(rid, None)

    async def run_call(
        self,
        rid: str,
        endpoint: str,
        body: Any,
        started: float,
        request_id: str,
        seen: dict[str, Any],
    ) -> None:
        key = seen["key"] = await authenticate(self.authorization)  # revoked: refused now
        life = await Lifecycle.begin(
            key=key,
            raw_body=orjson.dumps(body),
            endpoint=endpoint,
            rid=request_id,
            embed=embedder(key),
        )
        seen["ran"] = True
        async with life:  # a closed socket (ClientGone) or a cancel: cut off, drained, metered
            call = life.call
            await life.start()
            try:
                async for batch in life:
                    for chunk in batch:
                        await self.send_json({"type": "chunk", "id": rid, "data": chunk})
                    await asyncio.sleep(0)  # let a cancel or a closed socket be noticed
            except MidStreamError as exc:
                raise ApiError(502, str(exc), type="server_error", code="engine_failed") from exc
            await self.send_json(
                {
                    "type": "done",
                    "id": rid,
                    "usage": life.relay.usage(),
                    "request_id": call.rid,
                    "ttft_ms": call.counts.ttft_ms,
                    "duration_ms": int((time.perf_counter() - started) * 1000),
                    # hit, miss or bypass, where the tenant has a response cache
                    **({"cache": call.cache.outcome} if call.cache is not None else {}),
                }
            )
