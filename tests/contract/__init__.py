"""Every /v1 answer checked against OpenAI's published OpenAPI document.

``openai-openapi.json`` beside this file is a pinned subset of
https://github.com/openai/openai-openapi (see README.md here for where it came from and how
to refresh it). ``validate(component, body)`` checks one body against a named component;
``check_response`` picks the component the way a client generated from the spec would: the
operation's declared response for the path, method and content type, and ``ErrorResponse``
for every error status (OpenAI declares no error bodies per operation, but all of its errors
have that shape). Streamed answers are checked event by event, each ``data:`` line against
the operation's ``text/event-stream`` schema (the chat chunk) or, where the spec declares
only JSON (completions: "both the streamed and non-streamed response objects share the same
shape"), its JSON schema; a mid-stream error event against ``ErrorResponse``.

``install`` hooks httpx's transports for the test session so that every response a live
Inferplane stack gives any test — through the OpenAI SDK or plain httpx, streamed or not —
is checked as it is read; violations are collected and fail the test that caused them
(``tests/conftest.py``). Engines and other servers are not checked: only ports registered
with ``watch``.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).with_name("openai-openapi.json")
API_PREFIX = "/v1"


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` (still written in places of the 3.1 document) as
    JSON Schema: ``null`` joins the type (and the enum, which would refuse it otherwise);
    where there is no type to extend (a ``$ref``, an ``allOf``), the schema becomes
    ``anyOf: [itself, null]``."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    if node.pop("nullable", False) is not True:
        return node
    kind = node.get("type")
    if isinstance(kind, str):
        node["type"] = [kind, "null"]
        if "enum" in node and None not in node["enum"]:
            node["enum"] = [*node["enum"], None]
        return node
    if isinstance(kind, list):
        node["type"] = [*kind, "null"] if "null" not in kind else kind
        return node
    annotations = {k: node.pop(k) for k in ("description", "title", "deprecated") if k in node}
    return {"anyOf": [node, {"type": "null"}], **annotations}


# The one place where the document and OpenAI's API disagree for what we serve: streamed
# completions "share the same shape" as the completion object (the document's words, and
# its only schema for them), but OpenAI sends "finish_reason": null in every chunk before a
# choice finishes — as the chat chunk schema declares for chat. Streamed completion chunks
# are checked against the completion object with exactly that relaxed, nothing else.
STREAMED_COMPLETION = "CreateCompletionResponse (streamed chunk)"


def _streamed_completion(completion: dict[str, Any]) -> dict[str, Any]:
    chunk = copy.deepcopy(completion)
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    reason["type"], reason["enum"] = ["string", "null"], [*reason["enum"], None]
    return chunk


# The second: embeddings asked for with ``encoding_format: "base64"`` (what the official SDKs
# send unless told otherwise, and decode) come as a base64 string each, where the document
# declares only the list of floats. Those answers are checked with exactly that relaxed.
BASE64_EMBEDDINGS = "CreateEmbeddingResponse (base64)"


def _base64_embeddings(response: dict[str, Any], embedding: dict[str, Any]) -> dict[str, Any]:
    item = copy.deepcopy(embedding)
    item["properties"]["embedding"] = {"type": "string", "contentEncoding": "base64"}
    answer = copy.deepcopy(response)
    answer["properties"]["data"]["items"] = item
    return answer


# The third: deleting a response, whose 200 the document declares without a body. Its body
# is written from the document's own example of it (``x-oaiMeta``), every field required.
DELETED_RESPONSE = "Response deleted (the document's example)"
BY_EXAMPLE = {"deleteResponse": DELETED_RESPONSE}


def _deleted_response() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "deleted": {"const": True},
        },
        "required": ["id", "object", "deleted"],
        "additionalProperties": False,
    }


@cache
def spec() -> dict[str, Any]:
    document: dict[str, Any] = _nullable(json.loads(SPEC_PATH.read_text()))
    schemas = document["components"]["schemas"]
    schemas[STREAMED_COMPLETION] = _streamed_completion(schemas["CreateCompletionResponse"])
    schemas[BASE64_EMBEDDINGS] = _base64_embeddings(
        schemas["CreateEmbeddingResponse"], schemas["Embedding"]
    )
    schemas[DELETED_RESPONSE] = _deleted_response()
    return document


@cache
def _registry() -> Registry[Any]:
    registry: Registry[Any] = Registry().with_resource(
        "openai", DRAFT202012.create_resource(spec())
    )
    return registry


@cache
def _validator(component: str) -> Draft202012Validator:
    if component not in spec()["components"]["schemas"]:
        raise KeyError(
            f"{component} is not in the vendored spec (scripts/vendor_openai_openapi.py)"
        )
    schema = {"$ref": f"openai#/components/schemas/{component}"}
    return Draft202012Validator(schema, registry=_registry())


def errors(component: str, body: Any) -> list[str]:
    """What is wrong with ``body`` as a ``component``, one line per violation."""
    found = sorted(_validator(component).iter_errors(body), key=lambda e: list(e.absolute_path))
    return [
        f"{component} at {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in found
    ]


def validate(component: str, body: Any) -> None:
    problems = errors(component, body)
    if problems:
        raise AssertionError("\n".join(problems))


# --- which component an answer must match ------------------------------------------------


@cache
def _routes() -> list[tuple[re.Pattern[str], str, dict[str, Any]]]:
    routes = []
    for template, methods in spec()["paths"].items():
        parts = re.split(r"\{[^}]+\}", template)
        pattern = re.compile("^" + API_PREFIX + "[^/]+".join(map(re.escape, parts)) + "$")
        for method, operation in methods.items():
            routes.append((pattern, method, operation))
    return routes


def _component(schema: dict[str, Any] | None) -> str | None:
    ref = (schema or {}).get("$ref", "")
    return ref.rsplit("/", 1)[1] if ref else None


def expected(method: str, path: str, status: int, content_type: str) -> tuple[str | None, str]:
    """(component, how) for an answer: how is "json", "sse" or "raw" (not JSON: file
    content). None for a path the spec does not have (then it must be an error)."""
    if status >= 400:
        return "ErrorResponse", "json"
    for pattern, verb, operation in _routes():
        if verb == method.lower() and pattern.match(path):
            declared = operation["responses"].get(str(status)) or {}
            content = declared.get("content") or {}
            if declared and not content and operation.get("operationId") in BY_EXAMPLE:
                return BY_EXAMPLE[operation["operationId"]], "json"
            if "text/event-stream" in content_type:
                schema = content.get("text/event-stream") or content.get("application/json") or {}
                return _component(schema.get("schema")), "sse"
            schema = (content.get("application/json") or {}).get("schema") or {}
            if schema.get("type") == "string":
                return None, "raw"
            return _component(schema), "json"
    return None, "json"


# --- checking a live stack's answers ---------------------------------------------------------


@dataclass
class Log:
    ports: set[int] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    seen: set[tuple[str, str]] = field(default_factory=set)  # (component, "json" | "sse")
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, component: str, how: str, problems: list[str], where: str) -> None:
        with self.lock:
            self.seen.add((component, how))
            self.violations.extend(f"{where}: {p}" for p in problems)

    def reset(self) -> None:
        with self.lock:
            self.violations, self.seen = [], set()

    def take(self) -> list[str]:
        with self.lock:
            found, self.violations = self.violations, []
            return found


LOG = Log()


def watch(port: int) -> None:
    """Check every answer from this port (a live stack's web server) from now on."""
    LOG.ports.add(port)


class _Checker:
    """Splits an answer's bytes into what gets validated as they pass through unchanged."""

    def __init__(self, request: Any, response: Any) -> None:
        self.where = f"{request.method} {request.url.path} -> {response.status_code}"
        content_type = response.headers.get("content-type", "")
        self.component, self.how = expected(
            request.method, request.url.path, response.status_code, content_type
        )
        if response.status_code < 400 and self.component is None and self.how == "json":
            LOG.note("(none)", "json", [f"no OpenAI operation for {self.where}"], self.where)
        self.buffer = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> None:
        if self.component is None or self.how == "raw":
            return
        self.buffer += chunk
        if self.how == "sse":
            while b"\n\n" in self.buffer:
                event, _, rest = bytes(self.buffer).partition(b"\n\n")
                self.buffer = bytearray(rest)
                self._event(event)

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            self._check(data, streamed=True)

    def _check(self, data: bytes, *, streamed: bool) -> None:
        assert self.component is not None
        try:
            body = json.loads(data)
        except ValueError:
            LOG.note(self.component, self.how, [f"not JSON: {data[:200]!r}"], self.where)
            return
        component = self.component
        if streamed and component == "CreateCompletionResponse":
            component = STREAMED_COMPLETION
        if component == "CreateEmbeddingResponse" and _base64_vectors(body):
            component = BASE64_EMBEDDINGS
        if streamed and isinstance(body, dict) and "error" in body and "choices" not in body:
            component = "ErrorResponse"  # a mid-stream failure, then [DONE]
        LOG.note(component, self.how, errors(component, body), self.where)

    def close(self) -> None:
        if self.done or self.component is None or self.how == "raw":
            return
        self.done = True
        if self.how == "json" and self.buffer:
            self._check(bytes(self.buffer), streamed=False)
        elif self.how == "sse" and self.buffer.strip():
            self._event(bytes(self.buffer))


class _SyncStream:
    def __init__(self, inner: Any, checker: _Checker) -> None:
        self.inner, self.checker = inner, checker

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.checker.feed(chunk)
            yield chunk
        self.checker.close()

    def close(self) -> None:
        self.inner.close()


class _AsyncStream:
    def __init__(self, inner: Any, checker: _Checker) -> None:
        self.inner, self.checker = inner, checker

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.checker.feed(chunk)
            yield chunk
        self.checker.close()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _watched(request: Any) -> bool:
    return request.url.port in LOG.ports and request.url.path.startswith(API_PREFIX + "/")


def _base64_vectors(body: Any) -> bool:
    data = body.get("data") if isinstance(body, dict) else None
    return (
        bool(data)
        and isinstance(data, list)
        and isinstance(data[0], dict)
        and (isinstance(data[0].get("embedding"), str))
    )


def _hook(library: Any) -> None:
    """Wrap a library's transports so that the body of every watched answer passes a
    _Checker on its way to the caller, unchanged and as it arrives."""
    if getattr(library.HTTPTransport, "_contract_checked", False):
        return
    sync_send = library.HTTPTransport.handle_request
    async_send = library.AsyncHTTPTransport.handle_async_request
    # The clients check that a stream is their library's own kind.
    sync_stream = type("SyncStream", (_SyncStream, library.SyncByteStream), {})
    async_stream = type("AsyncStream", (_AsyncStream, library.AsyncByteStream), {})

    def handle_request(self: Any, request: Any) -> Any:
        response = sync_send(self, request)
        if _watched(request):
            response.stream = sync_stream(response.stream, _Checker(request, response))
        return response

    async def handle_async_request(self: Any, request: Any) -> Any:
        response = await async_send(self, request)
        if _watched(request):
            response.stream = async_stream(response.stream, _Checker(request, response))
        return response

    library.HTTPTransport.handle_request = handle_request
    library.AsyncHTTPTransport.handle_async_request = handle_async_request
    library.HTTPTransport._contract_checked = True


def install() -> None:
    """Hook the HTTP clients the tests use, once: httpx (plain test requests), httpx2 (what
    the OpenAI SDK sends with) and the WebSocket client."""
    for name in ("httpx", "httpx2"):
        try:
            _hook(importlib.import_module(name))
        except ImportError:
            continue
    _install_websockets()


# --- the WebSocket transport (/v1/ws) -------------------------------------------------------
# Its envelope is ours ({"type": "chunk" | "done" | "error", "id", ...}); what it carries is
# OpenAI's: a chunk's "data" is the endpoint's streamed object, "error" an Error, "usage" a
# CompletionUsage.

WS_CHUNK = {
    "chat.completions": "CreateChatCompletionStreamResponse",
    "completions": STREAMED_COMPLETION,
}


def ws_message(message: Any, endpoints: dict[Any, str], where: str) -> None:
    if not isinstance(message, dict):
        LOG.note("(ws)", "ws", [f"not a JSON object: {message!r:.200}"], where)
        return
    kind = message.get("type")
    if kind == "chunk":
        component = WS_CHUNK[endpoints.get(message.get("id"), "chat.completions")]
        LOG.note(component, "ws", errors(component, message.get("data")), where)
    elif kind == "error":
        LOG.note("Error", "ws", errors("Error", message.get("error")), where)
    elif kind == "done":
        LOG.note("CompletionUsage", "ws", errors("CompletionUsage", message.get("usage")), where)


def _install_websockets() -> None:
    from websockets.sync.client import ClientConnection

    sync_send, sync_recv = ClientConnection.send, ClientConnection.recv

    def watched(connection: ClientConnection) -> bool:
        try:
            address, request = connection.remote_address, connection.request
        except OSError:  # the socket is already closed: nothing more will come from it
            return False
        path = request.path if request is not None else ""
        return (
            isinstance(address, tuple)
            and address[1] in LOG.ports
            and path.startswith(API_PREFIX + "/")  # not the dashboard's own sockets
        )

    def send(connection: ClientConnection, message: Any, *args: Any, **kwargs: Any) -> None:
        if watched(connection) and isinstance(message, str | bytes):
            try:
                sent = json.loads(message)
            except ValueError:
                sent = None
            if isinstance(sent, dict) and sent.get("type") == "request":
                endpoints = connection.__dict__.setdefault("_contract_endpoints", {})
                endpoints[sent.get("id")] = sent.get("endpoint", "chat.completions")
        sync_send(connection, message, *args, **kwargs)

    def recv(connection: ClientConnection, *args: Any, **kwargs: Any) -> Any:
        data = sync_recv(connection, *args, **kwargs)
        if watched(connection) and isinstance(data, str | bytes):
            try:
                message = json.loads(data)
            except ValueError:
                message = data
            endpoints = connection.__dict__.get("_contract_endpoints", {})
            ws_message(message, endpoints, "WebSocket /v1/ws")
        return data

    ClientConnection.send = send  # type: ignore[method-assign,assignment]
    ClientConnection.recv = recv  # type: ignore[method-assign,assignment]
