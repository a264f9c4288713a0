"""The floor of a streaming relay in Python, for ``bench.overhead --floor`` (and
``bench.embeddings --floor``, whose whole answers it passes whole): an ASGI app under
the gateway's own server (uvicorn, the same workers) that passes a request's body to the
engine and the engine's SSE bytes back as they are read, with the gateway's HTTP client
(aiohttp) and nothing else: no key, no limits, no admission, no parsing, no metering.

What the gateway costs per token beyond this is what its own work costs; this is what the
server and the two sockets cost. ``ENGINE_URL`` names the engine.
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp

_session: aiohttp.ClientSession | None = None


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global _session
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if _session is None:
        _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    url = os.environ["ENGINE_URL"] + scope["path"]
    headers = {"content-type": "application/json"}
    async with _session.post(url, data=body, headers=headers) as response:
        if response.content_length is not None:  # a whole answer (embeddings): passed whole
            data = await response.read()
            kind = response.headers.get("content-type", "application/json").encode()
            size = str(len(data)).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [(b"content-type", kind), (b"content-length", size)],
                }
            )
            await send({"type": "http.response.body", "body": data})
            return
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        while data := await response.content.readany():
            await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
