"""Speaking to an ASGI app as the server does (asgiref's ``ApplicationCommunicator``)."""

from __future__ import annotations

from typing import Any

from asgiref.testing import ApplicationCommunicator

WAIT_SECONDS = 30  # for each message: a bound on a hang, never reached by a passing test


async def asgi_answer(communicator: ApplicationCommunicator) -> tuple[dict[str, Any], bytes]:
    """The answer's ``http.response.start`` message and its whole body."""
    start = await communicator.receive_output(timeout=WAIT_SECONDS)
    body = b""
    while True:
        part = await communicator.receive_output(timeout=WAIT_SECONDS)
        body += part.get("body", b"")
        if not part.get("more_body"):
            return start, body
