"""Every kind of answer /v1 serves, against a live stack and a real engine, checked against
OpenAI's published schema (tests/contract checks every /v1 answer of every test; these make
sure each kind is produced at least once, and that the checker did see it — a checker that
saw nothing would pass everything). Tool calls, which the tiny CPU model cannot make, are
checked where their answer is assembled (tests/inference/test_responses.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam
from websockets.sync.client import connect

from tests import contract
from tests.serving import World

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


def _checked(*kinds: tuple[str, str]) -> None:
    missing = set(kinds) - contract.LOG.seen
    assert not missing, f"not checked: {sorted(missing)}; checked: {sorted(contract.LOG.seen)}"


def _post(world: World, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(world.stack.url + path, json=body, headers=headers, timeout=60)


def test_models_list_and_retrieve(world: World) -> None:
    _, key = world.tenant()
    client = world.stack.openai(key)
    assert [m.id for m in client.models.list()] == ["tiny-chat"]
    assert client.models.retrieve("tiny-chat").owned_by
    _checked(("ListModelsResponse", "json"), ("Model", "json"))


def test_chat_completion_whole_with_choices_and_logprobs(world: World) -> None:
    _, key = world.tenant()
    reply = world.stack.openai(key).chat.completions.create(
        model="tiny-chat", messages=CHAT, max_tokens=4, n=2, logprobs=True, top_logprobs=2
    )
    assert len(reply.choices) == 2 and reply.choices[0].message.refusal is None
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content
    _checked(("CreateChatCompletionResponse", "json"))


def test_chat_completion_streamed_with_usage(world: World) -> None:
    _, key = world.tenant()
    stream = world.stack.openai(key).chat.completions.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=4,
        n=2,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    _checked(("CreateChatCompletionStreamResponse", "sse"))


def test_completions_whole_and_streamed(world: World) -> None:
    _, key = world.tenant()
    client = world.stack.openai(key)
    whole = client.completions.create(
        model="tiny-chat", prompt=["Hi", "Bye"], max_tokens=3, logprobs=2, echo=False
    )
    assert len(whole.choices) == 2 and whole.choices[0].logprobs is not None
    streamed = list(
        client.completions.create(
            model="tiny-chat",
            prompt="Hi",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == 3
    _checked(("CreateCompletionResponse", "json"), (contract.STREAMED_COMPLETION, "sse"))


def test_every_error_status_has_openais_error_shape(world: World) -> None:
    _, key = world.tenant(rpm=1)
    url = world.stack.url
    bad_key = {"authorization": "Bearer sk-ip-0123456789ab_not-a-real-secret-at-all-xxxxxxxx"}
    statuses = [
        _post(world, key, "/v1/chat/completions", {"model": "tiny-chat"}).status_code,
        httpx.get(f"{url}/v1/models", headers=bad_key).status_code,
        _post(world, key, "/v1/chat/completions", {"model": "nope", "messages": CHAT}).status_code,
        httpx.delete(f"{url}/v1/chat/completions", headers=bad_key).status_code,
        httpx.get(f"{url}/v1/nothing-here", headers=bad_key).status_code,
        httpx.post(
            f"{url}/v1/chat/completions",
            content=b"x" * (5 << 20),
            headers={"authorization": f"Bearer {key}"},
        ).status_code,
    ]
    body = {"model": "tiny-chat", "messages": CHAT, "max_tokens": 1}
    statuses += [_post(world, key, "/v1/chat/completions", body).status_code for _ in range(2)]
    assert statuses == [400, 401, 404, 405, 404, 413, 200, 429]
    _checked(("ErrorResponse", "json"))
    assert not contract.LOG.violations


def test_websocket_messages_carry_openais_shapes(world: World) -> None:
    _, key = world.tenant()
    url = world.stack.url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        requests = [
            {
                "type": "request",
                "id": "c",
                "body": {"model": "tiny-chat", "messages": CHAT, "max_tokens": 2},
            },
            {
                "type": "request",
                "id": "t",
                "endpoint": "completions",
                "body": {"model": "tiny-chat", "prompt": "Hi", "max_tokens": 2},
            },
            {"type": "request", "id": "e", "body": {"model": "nope", "messages": CHAT}},
        ]
        for request in requests:
            ws.send(json.dumps(request))
        ends: set[tuple[str, str]] = set()
        while len(ends) < 3:
            message = json.loads(ws.recv(timeout=30))
            if message["type"] in ("done", "error"):
                ends.add((message["id"], message["type"]))
    assert ends == {("c", "done"), ("t", "done"), ("e", "error")}
    _checked(
        ("CreateChatCompletionStreamResponse", "ws"),
        (contract.STREAMED_COMPLETION, "ws"),
        ("CompletionUsage", "ws"),
        ("Error", "ws"),
    )
