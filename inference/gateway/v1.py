"""The ``/v1`` endpoints as plain ASGI apps (routed in ``controlplane.asgi``).

Each runs the response in a task of its own, so that the client leaving (ASGI
``http.disconnect``) is noticed at once and cancels it: the engine request is closed (vLLM
aborts the sequence), the slot and limits are released and the tokens so far are metered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import orjson
from django.conf import settings
from django.db import DatabaseError
from redis.exceptions import RedisError

from contract import Servable
from controlplane.logs import request_id_new
from inference.gateway import cache, metrics
from inference.gateway.auth import KeyInfo, authenticate, bearer_token
from inference.gateway.call import MidStreamError
from inference.gateway.catalog import catalog_view
from inference.gateway.errors import ApiError, model_not_found, overloaded
from inference.gateway.headless import embedder
from inference.gateway.lifecycle import Lifecycle

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

JSON = (b"content-type", b"application/json")
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
SSE_DONE = b"data: [DONE]\n\n"
YIELD_EVERY = 8  # batches written between two forced yields to the event loop


def sse_frame(batch: list[dict[str, Any]]) -> bytes:
    """One batch of chunks as the SSE events of one write."""
    dumps = orjson.dumps
    return b"".join([b"data: " + dumps(chunk) + b"\n\n" for chunk in batch])


def sse_error(message: str) -> bytes:
    """The event that ends a stream the engine failed mid-way (then ``[DONE]``)."""
    error = {
        "error": {
            "message": message,
            "type": "server_error",
            "param": None,
            "code": "engine_failed",
        }
    }
    return b"data: " + orjson.dumps(error) + b"\n\n"


class GatewayHttpConsumer:
    """One ``/v1`` HTTP request, as a plain ASGI app (``as_asgi``). Before it reads a byte of
    the body it checks the method, the declared size and (``needs_key``) the API key, so an
    unauthenticated client can make it read nothing; a body that grows past the cap is cut
    off at the cap. An early answer ends it: the rest of the body is never read.

    Not a Channels consumer: a request needs no channel layer, nor Channels' dispatch (a task
    per ``receive``, ``asyncio.wait`` around them, a task cancelled at every answer's end)."""

    methods: tuple[str, ...] = ("POST",)
    needs_key = True
    endpoint = "other"  # the metrics' endpoint label

    def __init__(self, scope: Scope, send: Send) -> None:
        self.scope = scope
        self.base_send = send  # the server's own
        self.key: KeyInfo | None = None
        # The request's id, on every line logged for it and on its answer, error or not.
        self.rid = request_id_new()
        # The request ran (a call was made): it is metered and counted when it settles, so
        # an error it then answers is not counted again as a refusal.
        self.ran = False
        self.started = False  # the answer's status and headers are sent
        self.answered = False  # and its last byte
        # A stream's last event when it fails after it began (its status is sent): set by
        # the stream, in its own protocol's shape.
        self.failure_event: Callable[[ApiError], bytes] | None = None

    @classmethod
    def as_asgi(cls) -> Any:  # an ASGI app, which Django's path() types as a view
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            await cls(scope, send).serve(receive)

        return app

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.scope["headers"]:
            if key == name:
                return bytes(value)
        return None

    @property
    def checked_key(self) -> KeyInfo:
        """The key check_before_body accepted (handlers of ``needs_key`` endpoints only)."""
        if self.key is None:
            raise RuntimeError("the key is checked before the body is read")
        return self.key

    def max_body(self) -> int:
        return int(settings.INFERPLANE_MAX_BODY_BYTES)

    def too_large(self) -> ApiError:
        return ApiError(
            413,
            f"Request body too large: the limit is {self.max_body()} bytes.",
            code="request_too_large",
        )

    async def check_before_body(self) -> ApiError | None:
        if self.scope["method"] not in self.methods:
            return ApiError(
                405,
                f"Method {self.scope['method']} is not allowed here; use "
                f"{', '.join(self.methods)}.",
                code="method_not_allowed",
                headers={"allow": ", ".join(self.methods)},
            )
        declared = self.header(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body():
            return self.too_large()
        if self.needs_key:
            try:
                self.key = await authenticate(bearer_token(self.header(b"authorization")))
            except ApiError as error:
                return error
            except (RedisError, DatabaseError):  # a key not cached yet needs the database
                return overloaded(1, "The service is briefly unavailable. Retry in a moment.")
        return None

    async def serve(self, receive: Receive) -> None:
        # Before the first receive: the server hands the app no message until body bytes
        # arrive, and a client that announces a body need not send any.
        early = await self.check_before_body()
        if early is not None:
            await self.send_error(early)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: the client left
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body():
                await self.send_error(self.too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        # The response in a task of its own, so that the client leaving is noticed at once:
        # after the body, ``receive`` answers ``http.disconnect`` when the client leaves, or
        # once the answer is complete (ASGI), whichever is first.
        task = asyncio.create_task(self.respond(b"".join(chunks)))
        try:
            await receive()
        finally:  # also when the server cancels this (its shutdown): the task goes with it
            if not self.answered:
                task.cancel()  # the client left mid-response
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def respond(self, body: bytes) -> None:
        try:
            await self.handle_request(body)
            if not self.answered:
                raise RuntimeError(f"{type(self).__name__} ended without finishing its answer")
        except ApiError as error:
            await self.send_error(error)
        except asyncio.CancelledError:
            raise
        except (RedisError, DatabaseError):
            # Limits and admission live in Redis: without it, refuse (never serve unmetered).
            # The database is needed only for what no cache holds yet (a budget's first use).
            log.warning("Redis or the database unavailable while serving %s", self.scope["path"])
            await self.send_error(
                overloaded(1, "The service is briefly unavailable. Retry in a moment.")
            )
        except Exception:
            log.exception("unexpected error in %s", self.scope["path"])
            await self.send_error(
                ApiError(
                    500,
                    "The server had an error while processing your request.",
                    type="server_error",
                )
            )

    async def send_error(self, error: ApiError, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
        if self.started:  # too late for an error's status: the stream says it, and ends
            log.warning("%s: %s after the answer began", self.scope["path"], error.message)
            if not self.answered:
                failed = self.failure_event
                await self.send_body(failed(error) if failed is not None else b"")
            return
        if not self.ran:
            metrics.request_refused(
                error,
                endpoint=self.endpoint,
                tenant_slug=self.key.tenant_slug if self.key else None,
            )
        headers = [JSON, *extra, *((k.encode(), v.encode()) for k, v in error.headers.items())]
        await self.send_response(error.status, error.json(), headers=headers)

    async def send_response(
        self, status: int, body: bytes, *, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        """A whole answer, its size declared (``content-length``): not framed in chunks that
        every client would parse."""
        size = (b"content-length", str(len(body)).encode())
        await self.send_headers(status=status, headers=[*headers, size])
        await self.send_body(body)

    async def send_headers(
        self, *, status: int = 200, headers: Sequence[tuple[bytes, bytes]] | None = None
    ) -> None:
        """Every answer names its request (``x-request-id``), as OpenAI's do."""
        headers = list(headers or ())
        if self.rid and not any(name == b"x-request-id" for name, _ in headers):
            headers.append((b"x-request-id", self.rid.encode()))
        self.started = True
        await self.base_send({"type": "http.response.start", "status": status, "headers": headers})

    async def send_body(self, body: bytes, *, more_body: bool = False) -> None:
        if not more_body:
            self.answered = True
        await self.base_send({"type": "http.response.body", "body": body, "more_body": more_body})

    async def handle_request(self, body: bytes) -> None:
        raise NotImplementedError


class CompletionConsumer(GatewayHttpConsumer):
    endpoint = "chat.completions"

    async def handle_request(self, body: bytes) -> None:
        life = await Lifecycle.begin(
            key=self.checked_key,
            raw_body=body,
            endpoint=self.endpoint,
            rid=self.rid,
            asked=cache.directives(
                self.header(b"cache-control"), self.header(b"x-inferplane-cache")
            ),
            embed=embedder(self.checked_key),
        )
        self.ran = True
        async with life:
            try:
                await life.start()
            except ApiError as error:
                await self.send_error(error, life.call.headers)
                return
            if life.call.parsed.stream:
                await self.stream(life)
            else:
                await self.whole(life)

    async def stream(self, life: Lifecycle) -> None:
        await self.send_headers(status=200, headers=[*SSE_HEADERS, *life.call.headers])
        self.failure_event = lambda error: sse_error(error.message) + SSE_DONE
        send = self.base_send
        written = 0
        try:
            async for batch in life:
                await send(
                    {"type": "http.response.body", "body": sse_frame(batch), "more_body": True}
                )
                # Neither await above need suspend (the engine's data may be buffered already,
                # and the socket accepts the write): yield now and then, so a client that left
                # is noticed within a few batches.
                written += 1
                if not written % YIELD_EVERY:
                    await asyncio.sleep(0)
        except MidStreamError as exc:
            await self.send_body(sse_error(str(exc)), more_body=True)
        await self.send_body(SSE_DONE)

    async def whole(self, life: Lifecycle) -> None:
        try:
            answer = await life.whole()
        except ApiError as error:
            await self.send_error(error, life.call.headers)
            return
        await self.send_response(200, orjson.dumps(answer), headers=[JSON, *life.call.headers])


class ChatCompletionsConsumer(CompletionConsumer):
    endpoint = "chat.completions"


class CompletionsConsumer(CompletionConsumer):
    endpoint = "completions"


class EmbeddingsConsumer(CompletionConsumer):
    """``POST /v1/embeddings``: the same life as a completion's (limits, fair admission on
    its prompt tokens, a replica of the model's pool, metering, the ledger), answered whole."""

    endpoint = "embeddings"


def _model_object(found: Servable) -> dict[str, Any]:
    """OpenAI's model object, and what the model is for (``task``: ``generate``, ``embed``
    or ``classify``), since each endpoint takes the models of one task."""
    return {
        "id": found.name,
        "object": "model",
        "created": found.created,
        "owned_by": found.owned_by,
        "task": found.model.task,
    }


class ModelsConsumer(GatewayHttpConsumer):
    methods = ("GET",)
    endpoint = "models"

    def max_body(self) -> int:
        return 0  # a GET carries no body

    async def handle_request(self, body: bytes) -> None:
        tenant = self.checked_key.tenant_id
        models = (await catalog_view().for_tenant(tenant)).callable_by(tenant)
        name = self.scope["url_route"]["kwargs"].get("model")
        if name is None:
            data: dict[str, Any] = {
                "object": "list",
                "data": [_model_object(found) for found in models.values()],
            }
        elif name in models:
            data = _model_object(models[name])
        else:
            raise model_not_found(name)
        await self.send_response(200, orjson.dumps(data), headers=[JSON])


class NotFoundConsumer(GatewayHttpConsumer):
    """Any other ``/v1`` path: answered before the body is read, whoever asks."""

    needs_key = False
    endpoint = "unknown"

    async def check_before_body(self) -> ApiError | None:
        return ApiError(
            404,
            f"Invalid URL ({self.scope['method']} {self.scope['path']})",
            code="unknown_url",
        )

    async def handle_request(self, body: bytes) -> None:
        raise NotImplementedError  # never reached: check_before_body always answers
