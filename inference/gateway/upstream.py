"""The engines' side: one shared aiohttp session per process, SSE parsing, engine errors, and
the watchdog that ends a stream the engine went silent on (``Watchdog``, ``Stalled``).

aiohttp rather than httpx on this path: its HTTP parser is C (llhttp) and reading a chunk
costs no task-group or cancel-scope machinery. Profiled under 64 concurrent streams, httpx's
pure-Python HTTP/1.1 reader was a quarter of the gateway's CPU (bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from django.conf import settings

from inference.gateway.checks import context_error
from inference.gateway.errors import ApiError, invalid_request

_sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

PATHS = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
# vLLM's abort by request id (served with ``--enable-scale-out``, behind the engine's API key).
ABORT_PATH = "/inference/v1/abort_requests"


def engine_request_ids(*, endpoint: str, rid: str, prompts: int) -> list[str]:
    """The ids vLLM gives the sequences of a request it got with ``x-request-id: rid``: chat
    ``chatcmpl-<rid>``; completions ``cmpl-<rid>-<i>``, one per prompt (its ``n`` copies of
    each are children of that id, aborted with it)."""
    if endpoint == "chat.completions":
        return [f"chatcmpl-{rid}"]
    return [f"cmpl-{rid}-{i}" for i in range(max(1, prompts))]


# Failures of the connection to an engine (refused, reset, closed mid-body, timed out).
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


def engine_session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = _sessions[loop] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=60, enable_cleanup_closed=True
            ),
            # No total or read timeout here: the relay bounds the wait for an engine's first
            # token and every silence mid-stream itself (relay.Relay; settings
            # INFERPLANE_ENGINE_FIRST_BYTE/STALL_TIMEOUT_SECONDS), since a hung engine
            # often shows up as silence, not as a closed connection.
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=settings.INFERPLANE_ENGINE_CONNECT_TIMEOUT_SECONDS
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
    return session


class SseBatches:
    """The ``data:`` payloads of an SSE stream, in batches: all that one read delivered.

    An object rather than an async generator: a read cancelled while it waits (the client
    left, a timeout) would close a generator for good, and with it the rest of the engine's
    stream; here the wait is all that is cancelled (aiohttp's ``readany`` loses nothing), so
    ``Relay.drain`` can still read the engine's last events and its final count.

    ``waiting_since`` is when the read now waiting began (None when none waits): the relay's
    one watchdog per stream reads it, rather than a timer armed and cancelled per read.
    """

    __slots__ = ("_buffer", "_content", "_time", "waiting_since")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._content = response.content
        self._buffer = b""
        self._time = asyncio.get_running_loop().time
        self.waiting_since: float | None = None

    def __aiter__(self) -> SseBatches:
        return self

    async def __anext__(self) -> list[bytes]:
        while b"\n\n" not in self._buffer:
            self.waiting_since = self._time()
            try:
                data = await self._content.readany()
            finally:
                self.waiting_since = None
            if not data:
                raise StopAsyncIteration
            self._buffer += data
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [
            e[6:] if e.startswith(b"data: ") else e[5:].lstrip()
            for e in events
            if e.startswith(b"data:")
        ]

    def stalled(self, exc: BaseException) -> None:
        """End the read now waiting (and any later one) with ``exc``."""
        self._content.set_exception(exc)


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


class Stalled(Exception):
    """The engine stopped sending mid-stream (a hung GPU, a stopped process, a partition)."""


class Watchdog:
    """One timer per stream for the engine's silences: it wakes every ``stall`` seconds at
    most, and ends a read that has waited that long with ``Stalled``. A read armed with its
    own timeout would cost a timer set and cancelled per token; time spent writing to a slow
    client is not the engine's silence and is not counted."""

    __slots__ = ("_batches", "_handle", "_loop", "_stall")

    def __init__(self, batches: SseBatches, stall: float, loop: asyncio.AbstractEventLoop) -> None:
        self._batches, self._stall, self._loop = batches, stall, loop
        self._handle = loop.call_later(stall, self._check)

    def _check(self) -> None:
        since = self._batches.waiting_since
        if since is not None and self._loop.time() - since >= self._stall:
            self._batches.stalled(Stalled(f"the engine sent nothing for {self._stall} s"))
            return
        start = self._loop.time() if since is None else since
        self._handle = self._loop.call_at(start + self._stall, self._check)

    def stop(self) -> None:
        self._handle.cancel()
