"""The engines' side: one shared HTTP client per process, SSE parsing, engine errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson

from inference.api.errors import ApiError, invalid_request
from inference.api.schema import context_error

_clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


def engine_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=4096, max_keepalive_connections=512, keepalive_expiry=60
            ),
            # No read timeout: a long generation is silent between tokens only briefly, and
            # a dead engine shows up as a closed connection, not as silence.
            timeout=httpx.Timeout(connect=3.0, read=None, write=30.0, pool=30.0),
        )
    return client


async def sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an SSE stream, as they arrive."""
    buffer = b""
    async for data in response.aiter_raw():
        buffer += data
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2 :]
            if event.startswith(b"data: "):
                yield event[6:]
            elif event.startswith(b"data:"):
                yield event[5:].lstrip()


def engine_error(status: int, body: bytes) -> ApiError:
    """An engine's refusal of the request itself (4xx), in OpenAI's shape."""
    message = ""
    try:
        data = orjson.loads(body)
        error = data.get("error", data) if isinstance(data, dict) else {}
        message = str(error.get("message") or "")
    except (orjson.JSONDecodeError, AttributeError):
        message = body[:500].decode(errors="replace")
    lowered = message.lower()
    if "context length" in lowered or "maximum model length" in lowered or "too long" in lowered:
        return context_error(message)
    if status == 400 or status == 422:
        return invalid_request(message or "The engine refused the request.")
    return ApiError(status, message or "The engine refused the request.", type="server_error")
