"""The checker that holds every /v1 answer to OpenAI's published schema (tests/contract):
it must catch what a strict client would reject, accept what OpenAI itself sends, and see
answers through both client libraries the tests use, or it would pass vacuously."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests import contract

CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "tiny-chat",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def _with(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    *parents, last = path.split(".")
    node: Any = body
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is _DROP:
        del node[last]
    else:
        node[last] = value
    return body


_DROP = object()


def test_a_complete_chat_completion_passes() -> None:
    contract.validate("CreateChatCompletionResponse", CHAT)


@pytest.mark.parametrize(
    ("path", "value", "complaint"),
    [
        ("choices.0.message.refusal", _DROP, "'refusal' is a required property"),
        ("choices.0.finish_reason", "done", "is not one of"),
        ("system_fingerprint", None, "None is not of type 'string'"),
        ("usage.total_tokens", _DROP, "'total_tokens' is a required property"),
        ("object", "text_completion", "is not one of"),
    ],
)
def test_what_a_strict_client_rejects_is_caught(path: str, value: Any, complaint: str) -> None:
    found = contract.errors("CreateChatCompletionResponse", _with(CHAT, path, value))
    assert any(complaint in line for line in found), found


def test_nullable_is_read_as_openai_means_it() -> None:
    """`nullable: true` (OpenAPI 3.0, still in the 3.1 document) admits null and nothing
    else: a chunk's finish_reason may be null until the choice ends, never a number."""
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}],
        "usage": None,
    }
    assert contract.errors("CreateChatCompletionStreamResponse", chunk) == []
    wrong = _with(chunk, "choices.0.finish_reason", 3)
    assert contract.errors("CreateChatCompletionStreamResponse", wrong)


def test_streamed_completions_relax_only_finish_reason() -> None:
    chunk = {
        "id": "c",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
    }
    assert contract.errors(contract.STREAMED_COMPLETION, chunk) == []
    assert contract.errors("CreateCompletionResponse", chunk)  # the whole object needs one
    assert contract.errors(contract.STREAMED_COMPLETION, _with(chunk, "usage", None))


def test_errors_must_carry_param_and_code() -> None:
    assert contract.errors("ErrorResponse", {"error": {"message": "x", "type": "t"}})
    full = {"error": {"message": "x", "type": "t", "param": None, "code": None}}
    assert contract.errors("ErrorResponse", full) == []


def test_the_component_follows_the_operation() -> None:
    assert contract.expected("GET", "/v1/models", 200, "application/json") == (
        "ListModelsResponse",
        "json",
    )
    assert contract.expected("GET", "/v1/models/a:b", 200, "application/json")[0] == "Model"
    assert contract.expected("POST", "/v1/chat/completions", 200, "text/event-stream")[0] == (
        "CreateChatCompletionStreamResponse"
    )
    assert contract.expected("POST", "/v1/anything", 429, "application/json")[0] == (
        "ErrorResponse"
    )
    assert contract.expected("GET", "/v1/files/f/content", 200, "application/jsonl") == (
        None,
        "raw",
    )


class _Wrong(BaseHTTPRequestHandler):
    """A server that answers like a careless gateway: no refusal, and a bad error body."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path.endswith("/completions") and "chat" not in self.path:
            self._send(400, {"error": {"message": "bad"}})
        else:
            self._send(200, _with(CHAT, "choices.0.message.refusal", _DROP))

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "m"}]})

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def wrong_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Wrong)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    contract.watch(server.server_port)
    yield f"http://127.0.0.1:{server.server_port}"
    contract.LOG.ports.discard(server.server_port)
    contract.LOG.take()  # what this test provoked on purpose
    server.shutdown()


def test_answers_are_checked_through_the_sdk_and_plain_httpx(wrong_server: str) -> None:
    client = OpenAI(base_url=f"{wrong_server}/v1", api_key="k", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    client.models.list()
    httpx.post(f"{wrong_server}/v1/completions", json={})
    found = contract.LOG.take()
    assert any("'refusal' is a required property" in line for line in found), found
    assert any("ListModelsResponse at data/0: 'object' is a required property" in f for f in found)
    assert any("POST /v1/completions -> 400" in line and "'param'" in line for line in found)


def test_other_servers_are_not_checked(wrong_server: str) -> None:
    contract.LOG.ports.discard(int(wrong_server.rsplit(":", 1)[1]))
    httpx.post(f"{wrong_server}/v1/chat/completions", json={})
    assert contract.LOG.take() == []
