"""Requests shaped to hurt: many sequences in one request, bodies that never end, keys that
do not exist, answers that do not fit. Against a live stack and a real engine."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from fleet.models import Model
from tests.live import Stack, engine_counters, settled_counters, stack_start, wait_for
from tests.serving import World, catalog_everywhere, world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello, how are you?"}]
BODY = {"model": "tiny-chat", "messages": CHAT, "max_tokens": 6, "ignore_eos": True}


def _post(world: World, path: str, key: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(world.stack.url + path, json=body, headers=headers, timeout=60)


def _set_capacity(world: World, max_inflight: int) -> None:
    world_rows(world.engines, max_inflight=max_inflight)


# --- One request, many sequences ---------------------------------------------------------------


def test_a_request_larger_than_a_replica_is_refused(world: World) -> None:
    _set_capacity(world, 8)
    _, key = world.tenant()
    nine = {"model": "tiny-chat", "prompt": ["a"] * 9, "max_tokens": 2}
    response = _post(world, "/v1/completions", key, nine)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] == "prompt"
    assert "9 sequences" in error["message"] and "at most 8" in error["message"]
    chat = {"model": "tiny-chat", "messages": CHAT, "n": 9, "max_tokens": 2}
    response = _post(world, "/v1/chat/completions", key, chat)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    many = {"model": "tiny-chat", "prompt": ["a"] * 129, "max_tokens": 2}
    response = _post(world, "/v1/completions", key, many)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    # 2 prompts x n=4 fit a replica of eight exactly, and are metered in full.
    fits = {"model": "tiny-chat", "prompt": ["a b", "c d e"], "n": 4, "max_tokens": 5}
    response = _post(world, "/v1/completions", key, {**fits, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert sorted(c["index"] for c in body["choices"]) == list(range(8))
    assert body["usage"]["completion_tokens"] == 8 * 5
    record = wait_for(lambda: world.records(request_id=response.headers["x-request-id"]))[0]
    assert record.completion_tokens == 40
    assert record.prompt_tokens == body["usage"]["prompt_tokens"]


def test_limits_count_every_sequence(world: World) -> None:
    _set_capacity(world, 16)
    _, key = world.tenant(max_concurrency=4)
    client = world.stack.openai(key)
    with pytest.raises(openai.BadRequestError) as too_many:  # never fits: 400, not 429
        client.chat.completions.create(model="tiny-chat", messages=CHAT, n=5, max_tokens=2)
    assert "5 sequences" in too_many.value.message
    assert too_many.value.code == "request_too_large"
    _, key = world.tenant(tpm=1000)
    with pytest.raises(openai.RateLimitError) as err:  # 4 x 300 tokens > 1,000 a minute
        world.stack.openai(key).chat.completions.create(
            model="tiny-chat", messages=CHAT, n=4, max_tokens=300
        )
    assert "Request too large" in err.value.message
    _, key = world.tenant(max_tokens_per_request=100)
    with pytest.raises(openai.BadRequestError) as bad:  # 4 x 30 tokens > 100 a request
        world.stack.openai(key).chat.completions.create(
            model="tiny-chat", messages=CHAT, n=4, max_tokens=30
        )
    assert "4 sequences" in bad.value.message
    # Unset max_tokens: the request's allowance is shared by its sequences.
    completion = world.stack.openai(key).chat.completions.create(
        model="tiny-chat", messages=CHAT, n=4, extra_body={"ignore_eos": True}
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 100


def test_the_engines_own_queue_stays_empty_whatever_the_request_shape(world: World) -> None:
    """Eight clients of one tenant each send 8 prompts x n=2 (16 sequences) again and again
    while another tenant sends one-token requests. The pool admits 16 sequences per replica
    (the engine runs 64 at once), so nothing ever waits inside the engine, where admission
    could not order it fairly. (Before, each of those requests took one slot of 16: 128
    sequences reached the engine and half of them waited in its queue.)"""
    _set_capacity(world, 16)
    _, heavy = world.tenant()
    light_tenant, light = world.tenant()
    engine = world.engines[0]
    stop = threading.Event()
    waiting: list[float] = []
    errors: list[str] = []

    served = [0]

    def flood() -> None:
        body = {"model": "tiny-chat", "prompt": [f"p{i}" for i in range(8)], "n": 2}
        body |= {"max_tokens": 24, "ignore_eos": True}
        while not stop.is_set():
            response = _post(world, "/v1/completions", heavy, body)
            if response.status_code != 200:
                errors.append(response.text)
            served[0] += 1

    def watch() -> None:
        while not stop.is_set():
            waiting.append(engine_counters(engine)["vllm:num_requests_waiting"])
            time.sleep(0.05)

    threads = [threading.Thread(target=flood) for _ in range(8)] + [threading.Thread(target=watch)]
    for thread in threads:
        thread.start()
    try:
        # The flood is on the engine (its admitted sequences running) before the light
        # tenant asks.
        wait_for(
            lambda: engine_counters(engine)["vllm:num_requests_running"] >= 8,
            timeout=60,
            every=0.02,
        )
        client = world.stack.openai(light)
        for _ in range(5):
            client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=1)
        wait_for(lambda: served[0] >= 24 and len(waiting) >= 10, timeout=120)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, errors[:3]
    # One request of 16 can be caught between its arrival and the engine's next step.
    assert max(waiting) <= 16, sorted(waiting)[-5:]
    assert len(world.records(tenant=light_tenant)) == 5 or wait_for(
        lambda: len(world.records(tenant=light_tenant)) == 5
    )


@pytest.mark.under_load
def test_a_cut_off_request_of_many_sequences_is_metered_in_full(world: World) -> None:
    """A client that leaves mid-stream is billed exactly what the engine generated for every
    sequence: the gateway aborts them by request id and reads the engine's final count."""
    _set_capacity(world, 16)
    engine = world.engines[0]
    before = settled_counters(engine)
    tenant, key = world.tenant()
    body = {"model": "tiny-chat", "prompt": ["one", "two", "three", "four"], "n": 2}
    body |= {"max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST",
        f"{world.stack.url}/v1/completions",
        headers={"authorization": f"Bearer {key}"},
        json=body,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i > 200:  # every sequence is well under way (each asks for 1,000 tokens)
                break
    record = wait_for(lambda: world.records(tenant=tenant), timeout=30)[0]
    after = settled_counters(engine)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert record.status == "cut_off"
    assert 0 < record.completion_tokens < 8 * 1000  # cut well before the end
    assert record.completion_tokens == generated  # the engine's own count, not a bound
    # Each prompt billed once (OpenAI's rule, and the engine's own usage report); the
    # engine's counter counts it once per sequence (n=2).
    assert record.prompt_tokens * 2 == (
        after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    )


# --- Bodies and keys ------------------------------------------------------------------------------


def _raw_exchange(world: World, head: bytes, body: bytes = b"", *, wait: float = 15) -> bytes:
    """Send a request head (and maybe part of a body) on a raw socket; what comes back."""
    host, port = world.stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_an_unauthenticated_body_is_never_read(world: World) -> None:
    """The key is checked before the body: a client without one is answered at once, even
    though it announced a megabyte and sent ten bytes of it."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000000"
    )
    answer = _raw_exchange(world, head, b'{"model": ')
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    _, key = world.tenant()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n"
        b"Authorization: Bearer " + key.encode()
    )
    answer = _raw_exchange(world, head)  # over the cap, announced: refused unread
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_control_plane_bodies_are_bounded_before_django_reads_them(world: World) -> None:
    head = b"POST /api/auth/token/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50000000"
    answer = _raw_exchange(world, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"application/json" in answer.split(b"\r\n\r\n")[0]

    def endless() -> Iterator[bytes]:  # chunked: no length announced, and it never ends
        for _ in range(4096):
            yield b"x" * 4096

    response = httpx.post(
        world.stack.url + "/app/login/",
        content=endless(),
        timeout=30,
        headers={"host": "127.0.0.1"},
    )
    assert response.status_code == 413
    assert world.stack.processes["web"].poll() is None


def test_the_engine_answers_only_the_platform(world: World) -> None:
    """The engines require the key from the platform's secret; the gateway sends it."""
    engine = world.engines[0].url
    refused = httpx.post(f"{engine}/v1/chat/completions", json=BODY, timeout=30)
    assert refused.status_code == 401
    _, key = world.tenant()
    assert _post(world, "/v1/chat/completions", key, BODY).status_code == 200


def test_reserved_chat_template_kwargs_are_refused(world: World) -> None:
    _, key = world.tenant()
    body = {
        "model": "tiny-chat",
        "messages": CHAT,
        "chat_template_kwargs": {"chat_template": "{{ 'pwned' }}"},
    }
    response = _post(world, "/v1/chat/completions", key, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs.chat_template"
    fine = {**body, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 2}
    assert _post(world, "/v1/chat/completions", key, fine).status_code == 200


def _chat_with(world: World, key: str, *parts: dict[str, Any]) -> httpx.Response:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": content}]}
    return _post(world, "/v1/chat/completions", key, {**body, "max_tokens": 2})


def test_media_parts_reach_only_a_model_that_takes_them(world: World) -> None:
    _, key = world.tenant()
    image = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/"}}
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    file = {"type": "file", "file": {"file_id": "file-abc"}}
    for part in (image, audio, file):
        response = _chat_with(world, key, part)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_content"
        assert error["param"] == "messages[0].content[1].type"
    assert _chat_with(world, key).status_code == 200  # text parts are fine
    # A vision model: images inline only (no URL the engine would fetch from inside).
    Model.objects.filter(name="tiny-chat").update(accepts_images=True)
    catalog_everywhere()
    response = _chat_with(world, key, image)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url.url"
    assert "data: URLs" in error["message"]
    inline = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    response = _chat_with(world, key, inline)  # ours passes it; this engine is text-only
    assert response.json().get("error", {}).get("code") != "unsupported_content"


# --- Answers that do not fit ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight_stack(serving_db_url: str) -> Iterator[Stack]:
    """A stack with small bounds, so that crossing them is quick to show."""
    stack = stack_start(
        serving_db_url,
        name="tight",
        extra_env={
            "INFERPLANE_MAX_RESPONSE_BYTES": "65536",
            "INFERPLANE_WS_AUTH_TIMEOUT_SECONDS": "1",
        },
    )
    yield stack
    stack.stop()


def test_a_non_streamed_answer_is_bounded(engine: Any, tight_stack: Stack) -> None:
    world_rows([engine])
    world = World(stack=tight_stack, engines=[engine])
    tenant, key = world.tenant()
    body = {"model": "tiny-chat", "messages": CHAT, "max_tokens": 400, "ignore_eos": True}
    body |= {"logprobs": True, "top_logprobs": 20}  # ~1 KB of JSON a token
    response = _post(world, "/v1/chat/completions", key, body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "response_too_large" and "stream=true" in error["message"]
    record = wait_for(lambda: world.records(tenant=tenant))[0]
    assert record.status == "error" and 0 < record.completion_tokens < 400  # stopped early
    streamed = httpx.post(
        tight_stack.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        content=orjson.dumps({**body, "stream": True}),
        timeout=60,
    )
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_a_socket_that_does_not_authenticate_is_closed(engine: Any, tight_stack: Stack) -> None:
    world_rows([engine])
    world = World(stack=tight_stack, engines=[engine])
    _, key = world.tenant()
    url = tight_stack.url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, open_timeout=10) as anonymous:
        message = json.loads(anonymous.recv(timeout=10))
        assert message["type"] == "error" and message["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed) as closed:
            anonymous.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    with connect(url, open_timeout=10) as known:  # authenticated by its first message
        known.send(json.dumps({"type": "auth", "api_key": key}))
        assert json.loads(known.recv(timeout=10))["type"] == "authenticated"
        time.sleep(1.5)
        request = {"type": "request", "id": "r", "body": {**BODY, "max_tokens": 2}}
        known.send(json.dumps(request))
        kinds = [json.loads(known.recv(timeout=30))["type"] for _ in range(3)]
        assert "chunk" in kinds
