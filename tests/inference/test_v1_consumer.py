"""The ``/v1`` endpoints' ASGI base (``inference.gateway.v1.GatewayHttpConsumer``), spoken to
as the server speaks to it: what a client receives when a handler answers, fails after its
stream began, or is left by its client mid-answer."""

from __future__ import annotations

import asyncio

import orjson
from asgiref.testing import ApplicationCommunicator

from inference.gateway.v1 import JSON, SSE_DONE, SSE_HEADERS, GatewayHttpConsumer, sse_error
from tests.asgi import asgi_answer


class _Whole(GatewayHttpConsumer):
    needs_key = False

    async def handle_request(self, body: bytes) -> None:
        await self.send_response(200, orjson.dumps({"echo": body.decode()}), headers=[JSON])


class _FailsMidStream(GatewayHttpConsumer):
    needs_key = False

    async def handle_request(self, body: bytes) -> None:
        await self.send_headers(status=200, headers=SSE_HEADERS)
        self.failure_event = lambda error: sse_error(error.message) + SSE_DONE
        await self.send_body(b'data: {"n": 1}\n\n', more_body=True)
        raise RuntimeError("a bug after the first event")


class _Slow(GatewayHttpConsumer):
    needs_key = False
    cancelled: asyncio.Event

    async def handle_request(self, body: bytes) -> None:
        await self.send_headers(status=200, headers=SSE_HEADERS)
        try:
            await asyncio.Event().wait()  # an answer that never ends by itself
        except asyncio.CancelledError:
            _Slow.cancelled.set()
            raise


def _request(consumer: type[GatewayHttpConsumer], body: bytes = b"{}") -> ApplicationCommunicator:
    scope = {"type": "http", "method": "POST", "path": "/v1/x", "headers": [], "url_route": {}}
    return ApplicationCommunicator(consumer.as_asgi(), scope)


async def test_a_whole_answer_declares_its_size() -> None:
    communicator = _request(_Whole)
    await communicator.send_input({"type": "http.request", "body": b"hi"})
    start, body = await asgi_answer(communicator)
    headers = dict(start["headers"])
    assert start["status"] == 200
    assert headers[b"content-length"] == str(len(body)).encode()  # not chunked
    assert orjson.loads(body) == {"echo": "hi"}
    assert b"x-request-id" in headers
    await communicator.send_input({"type": "http.disconnect"})  # the server, once it is sent
    await communicator.wait(timeout=10)


async def test_a_stream_that_fails_after_it_began_ends_with_its_error_not_a_hang() -> None:
    communicator = _request(_FailsMidStream)
    await communicator.send_input({"type": "http.request", "body": b"{}"})
    start, body = await asgi_answer(communicator)
    assert start["status"] == 200  # sent before the failure: it cannot change
    events = [e for e in body.split(b"\n\n") if e]
    assert events[0] == b'data: {"n": 1}'
    error = orjson.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error"
    assert events[2] == SSE_DONE.strip()
    await communicator.send_input({"type": "http.disconnect"})
    await communicator.wait(timeout=10)


async def test_a_client_that_leaves_mid_answer_cancels_the_handler() -> None:
    _Slow.cancelled = asyncio.Event()
    communicator = _request(_Slow)
    await communicator.send_input({"type": "http.request", "body": b"{}"})
    start = await communicator.receive_output(timeout=10)
    assert start["status"] == 200
    await communicator.send_input({"type": "http.disconnect"})
    await asyncio.wait_for(_Slow.cancelled.wait(), 10)
    await communicator.wait(timeout=10)
