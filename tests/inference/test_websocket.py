"""The WebSocket transport (``/v1/ws``): same pipeline, chunks as JSON messages."""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.live import wait_for
from tests.serving import World

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

BODY = {
    "model": "tiny-chat",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 6,
    "ignore_eos": True,
}


def _ws(world: World, key: str | None = None) -> ClientConnection:
    url = world.stack.url.replace("http://", "ws://") + "/v1/ws"
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return connect(url, additional_headers=headers, open_timeout=10)


def _until_end(ws: ClientConnection, rid: str) -> list[dict[str, Any]]:
    messages = []
    while True:
        message = json.loads(ws.recv(timeout=30))
        if message.get("id") == rid:
            messages.append(message)
            if message["type"] in ("done", "error"):
                return messages


def test_streams_chunks_and_meters(world: World) -> None:
    tenant, key = world.tenant()
    with _ws(world, key) as ws:
        ws.send(json.dumps({"type": "request", "id": "r1", "body": BODY}))
        messages = _until_end(ws, "r1")
    chunks = [m["data"] for m in messages if m["type"] == "chunk"]
    done = messages[-1]
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 6
    assert done["ttft_ms"] is not None
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    record = wait_for(lambda: world.records(request_id=done["request_id"]))[0]
    assert record.tenant_id == tenant.pk and record.completion_tokens == 6


def test_auth_by_first_message_and_concurrent_requests(world: World) -> None:
    _, key = world.tenant()
    with _ws(world) as ws:
        ws.send(json.dumps({"type": "request", "id": "early", "body": BODY}))
        assert json.loads(ws.recv(timeout=10))["error"]["code"] == "invalid_api_key"
        ws.send(json.dumps({"type": "auth", "api_key": key}))
        assert json.loads(ws.recv(timeout=10)) == {"type": "authenticated"}
        for rid in ("a", "b", "c"):
            ws.send(json.dumps({"type": "request", "id": rid, "body": BODY}))
        ends: dict[str, str] = {}
        while len(ends) < 3:
            message = json.loads(ws.recv(timeout=30))
            if message["type"] in ("done", "error"):
                ends[message["id"]] = message["type"]
    assert ends == {"a": "done", "b": "done", "c": "done"}


def test_errors_are_openai_shaped_per_request(world: World) -> None:
    _, key = world.tenant()
    with _ws(world, key) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "request",
                    "id": "x",
                    "body": {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]},
                }
            )
        )
        error = _until_end(ws, "x")[-1]["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        ws.send("not json")
        assert json.loads(ws.recv(timeout=10))["error"]["type"] == "invalid_request_error"


def test_cancel_stops_the_request_and_meters_it(world: World) -> None:
    tenant, key = world.tenant()
    body = {**BODY, "max_tokens": 1000}
    with _ws(world, key) as ws:
        ws.send(json.dumps({"type": "request", "id": "long", "body": body}))
        assert json.loads(ws.recv(timeout=30))["type"] == "chunk"
        ws.send(json.dumps({"type": "cancel", "id": "long"}))
    record = wait_for(lambda: world.records(tenant=tenant))[0]
    assert record.status == "cut_off" and record.completion_tokens < 1000


def test_bad_key_on_upgrade_is_refused(world: World) -> None:
    with _ws(world, "sk-ip-000000000000_wrong") as ws:
        assert json.loads(ws.recv(timeout=10))["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
