"""The OpenAI-compatible gateway, driven with the official SDK against a live server and a
real vLLM CPU engine."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import openai
import orjson
import pytest
from django.db import transaction
from openai.types.chat import ChatCompletionMessageParam

from billing.models import Price, UsageRecord
from controlplane.redis import redis_sync
from devkit.tiny_model import continuation
from fleet.models import Model, Pool
from inference.models import KeyCacheInvalidation
from tenants.models import ApiKey, AuditEvent
from tenants.services import api_key_limits_update, api_key_revoke, tenant_update
from tests.engines import Engine
from tests.live import settled_counters, wait_for
from tests.serving import World, catalog_everywhere, world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello, how are you?"}]


def _record(world: World, request_id: str) -> UsageRecord:
    records: list[UsageRecord] = wait_for(lambda: world.records(request_id=request_id), timeout=30)
    return records[0]


# --- Happy paths -----------------------------------------------------------------------------


def test_models_lists_what_the_tenant_may_use(world: World) -> None:
    _, key = world.tenant()
    other, _ = world.tenant()
    private = Model.objects.create(
        name="private-chat", served_name="tiny-chat", context_length=1024, is_public=False
    )
    private.allowed_tenants.add(other)
    Pool.objects.create(name="private", kind="dedicated", model=private)
    catalog_everywhere()
    client = world.stack.openai(key)
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("private-chat")
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="private-chat", messages=CHAT, max_tokens=2)


def test_chat_unstreamed_with_usage(world: World) -> None:
    _, key = world.tenant()
    response = world.stack.openai(key).chat.completions.with_raw_response.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    completion = response.parse()
    assert completion.object == "chat.completion"
    assert completion.model == "tiny-chat"
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens > 0
    request_id = response.headers["x-request-id"]
    record = _record(world, request_id)
    assert (record.prompt_tokens, record.completion_tokens) == (
        completion.usage.prompt_tokens,
        12,
    )
    assert record.status == "ok" and record.endpoint == "chat.completions"
    # The replica by name: its address is internal.
    assert record.ttft_ms is not None
    assert record.replica == world.pool().replicas.get(url=world.engines[0].url).name


def test_chat_streamed_matches_unstreamed_and_reports_usage(world: World) -> None:
    _, key = world.tenant()
    client = world.stack.openai(key)
    args = dict(model="tiny-chat", messages=CHAT, max_tokens=20, temperature=0, seed=7)
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same answer both ways
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.model == "tiny-chat" for c in chunks)


def test_stream_without_include_usage_has_no_usage_chunk(world: World) -> None:
    """Clients that iterate ``chunk.choices[0]`` must not meet an empty usage chunk."""
    _, key = world.tenant()
    chunks = list(
        world.stack.openai(key).chat.completions.create(
            model="tiny-chat", messages=CHAT, max_tokens=5, stream=True
        )
    )
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_completions_streamed_and_not(world: World) -> None:
    _, key = world.tenant()
    client = world.stack.openai(key)
    whole = client.completions.create(
        model="tiny-chat", prompt="The quick brown fox", max_tokens=10, temperature=0
    )
    assert whole.object == "text_completion" and whole.usage is not None
    # The tiny model continues a prompt ending in " fox" with its other cycle.
    assert whole.choices[0].text == continuation("fox", 10)
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"
    streamed = list(
        client.completions.create(
            model="tiny-chat",
            prompt="The quick brown fox",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert streamed[-1].usage is not None
    assert streamed[-1].usage.total_tokens == whole.usage.total_tokens


def test_vllm_sampling_extras_pass_through(world: World) -> None:
    _, key = world.tenant()
    completion = world.stack.openai(key).chat.completions.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=30,
        extra_body={"min_tokens": 30, "ignore_eos": True, "top_k": 5, "repetition_penalty": 1.1},
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 30


def test_async_sdk_concurrent_streams(world: World) -> None:
    _, key = world.tenant()

    async def one(client: openai.AsyncOpenAI) -> int:
        stream = await client.chat.completions.create(
            model="tiny-chat",
            messages=CHAT,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = 0
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return usage

    async def main() -> list[int]:
        async with world.stack.async_openai(key) as client:
            return await asyncio.gather(*(one(client) for _ in range(12)))

    assert asyncio.run(main()) == [16] * 12


# --- Errors in OpenAI's shape ----------------------------------------------------------------


def _raw(
    world: World, method: str, path: str, key: str | None = None, **kwargs: Any
) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.request(method, world.stack.url + path, headers=headers, timeout=30, **kwargs)


def _error(response: httpx.Response) -> dict[str, object]:
    error: dict[str, object] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_missing_and_wrong_keys_get_401(world: World) -> None:
    response = _raw(world, "GET", "/v1/models")
    assert response.status_code == 401 and _error(response)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as err:
        world.stack.openai("sk-ip-0123456789ab_not-a-real-secret").models.list()
    assert err.value.code == "invalid_api_key"
    _, key = world.tenant()
    forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    with pytest.raises(openai.AuthenticationError):
        world.stack.openai(forged).models.list()


def test_revoked_key_stops_within_a_second(world: World) -> None:
    tenant, key = world.tenant()
    client = world.stack.openai(key)
    client.models.list()  # cached now in the process and in Redis
    api_key_revoke(api_key=ApiKey.objects.get(tenant=tenant), actor=None)
    revoked_at = time.monotonic()

    def refused() -> bool:
        try:
            client.models.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_for(refused, timeout=5, every=0.05)
    assert time.monotonic() - revoked_at < 2.0  # design bound: 1 s in-process cache


def test_suspended_tenant_is_refused(world: World) -> None:
    tenant, key = world.tenant()
    world.stack.openai(key).models.list()
    tenant_update(tenant=tenant, actor=None, status="suspended")
    time.sleep(1.1)
    with pytest.raises(openai.AuthenticationError):
        world.stack.openai(key).models.list()


def test_revocation_and_suspension_during_a_redis_hiccup_still_take_effect(
    world: World, settings: Any
) -> None:
    """The control plane cannot reach Redis at the moment a key is revoked and a tenant is
    suspended: the invalidations wait in the database's outbox, and the drains apply them as soon
    as Redis answers again. (Before, they were logged and lost: the revoked key kept working
    for as long as its cache entry lived, five minutes.)"""
    tenant, key = world.tenant()
    suspended, other_key = world.tenant()
    for k in (key, other_key):
        world.stack.openai(k).models.list()  # cached in Redis by the gateway
    live_redis = settings.STATE_REDIS_URL
    settings.STATE_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    redis_sync.cache_clear()
    try:
        with transaction.atomic():
            api_key_revoke(api_key=ApiKey.objects.get(tenant=tenant), actor=None)
            tenant_update(tenant=suspended, actor=None, status="suspended")
            # In the outbox with the changes themselves. Counted before the commit: once
            # committed, the stack's drains (whose Redis answers) may apply them at any moment
            # (a fresh-clone run counted 1 here, the other already applied).
            assert KeyCacheInvalidation.objects.count() == 2
    finally:
        settings.STATE_REDIS_URL = live_redis
        redis_sync.cache_clear()

    def refused(k: str) -> bool:
        try:
            world.stack.openai(k).models.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_for(lambda: refused(key) and refused(other_key), timeout=20, every=0.5)
    assert KeyCacheInvalidation.objects.count() == 0


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"model": "tiny-chat"}, "messages", "Missing required parameter"),
        ({"model": "tiny-chat", "messages": []}, "messages", "at least 1"),
        (
            {"model": "tiny-chat", "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "Invalid value",
        ),
        ({"model": "tiny-chat", "messages": CHAT, "temperature": 3}, "temperature", "less than"),
        ({"model": "tiny-chat", "messages": CHAT, "max_tokens": 0}, "max_tokens", "greater"),
        ({"model": "tiny-chat", "messages": CHAT, "max_tokens": "ten"}, "max_tokens", "integer"),
        (
            {"model": "tiny-chat", "messages": CHAT, "chat_template": "{{ 7*7 }}"},
            "chat_template",
            "Unrecognized request argument",
        ),
        ({"model": "tiny-chat", "messages": CHAT, "priority": -100}, "priority", "Unrecognized"),
        (
            {"model": "tiny-chat", "messages": CHAT, "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when 'stream'",
        ),
        ({"model": "tiny-chat", "messages": CHAT, "max_tokens": 4096}, "max_tokens", "too large"),
    ],
)
def test_invalid_requests_get_400(
    world: World, body: dict[str, Any], param: str, fragment: str
) -> None:
    _, key = world.tenant()
    response = _raw(world, "POST", "/v1/chat/completions", key, json=body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in str(error["message"])


def test_malformed_json_and_non_object_get_400(world: World) -> None:
    _, key = world.tenant()
    for content in (b"{not json", b"[1, 2]"):
        response = _raw(world, "POST", "/v1/chat/completions", key, content=content)
        assert response.status_code == 400
        assert _error(response)["type"] == "invalid_request_error"


def test_context_length_exceeded(world: World) -> None:
    _, key = world.tenant()
    with pytest.raises(openai.BadRequestError) as err:
        world.stack.openai(key).chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "word " * 2000}], max_tokens=8
        )
    assert err.value.code == "context_length_exceeded"


def test_unknown_model_is_404(world: World) -> None:
    _, key = world.tenant()
    with pytest.raises(openai.NotFoundError) as err:
        world.stack.openai(key).chat.completions.create(model="gpt-9", messages=CHAT)
    assert err.value.code == "model_not_found"
    assert "gpt-9" in err.value.message


def test_wrong_method_is_405_and_unknown_url_404(world: World) -> None:
    _, key = world.tenant()
    response = _raw(world, "GET", "/v1/chat/completions", key)
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert _error(response)["code"] == "method_not_allowed"
    response = _raw(world, "POST", "/v1/models", key)
    assert response.status_code == 405
    response = _raw(world, "POST", "/v1/audio/speech", key, json={})
    assert response.status_code == 404 and _error(response)["code"] == "unknown_url"


def test_oversized_body_is_413(world: World) -> None:
    _, key = world.tenant()
    huge = {"model": "tiny-chat", "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    response = _raw(world, "POST", "/v1/chat/completions", key, content=orjson.dumps(huge))
    assert response.status_code == 413
    assert _error(response)["code"] == "request_too_large"


def test_max_tokens_bounded_by_the_tenants_limit(world: World) -> None:
    _, key = world.tenant(max_tokens_per_request=8)
    client = world.stack.openai(key)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=9)
    assert err.value.param == "max_tokens"
    # Unspecified max_tokens is capped at the limit, not refused.
    completion = client.chat.completions.create(
        model="tiny-chat", messages=CHAT, extra_body={"ignore_eos": True}
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 8


# --- Limits ----------------------------------------------------------------------------------


def test_rpm_limit_with_headers(world: World) -> None:
    _, key = world.tenant(rpm=3)
    client = world.stack.openai(key)
    seen = []
    for _ in range(3):
        response = client.chat.completions.with_raw_response.create(
            model="tiny-chat", messages=CHAT, max_tokens=1
        )
        seen.append(response.headers)
    assert [h["x-ratelimit-limit-requests"] for h in seen] == ["3", "3", "3"]
    assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["2", "1", "0"]
    assert all(h["x-ratelimit-reset-requests"].endswith("s") for h in seen)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=1)
    assert err.value.code == "rate_limit_exceeded"
    headers = err.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_tpm_limit_estimates_then_corrects(world: World) -> None:
    tenant, key = world.tenant(tpm=400)
    client = world.stack.openai(key)
    # Estimated at admission (prompt estimate + max_tokens 300), then corrected to the
    # engine's count (a few tokens), so the next request fits again.
    first = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=CHAT, max_tokens=300, stop=["e"]
    )
    assert first.headers["x-ratelimit-limit-tokens"] == "400"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) < 100
    # The correction lands as the request settles, just after the answer's last byte (the
    # same round trip spools its usage record: once that is in the ledger, it landed). A
    # request sent that very millisecond can still meet the estimate (CI, loaded, did).
    wait_for(lambda: len(world.records(tenant=tenant)) == 1, timeout=30)
    client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=300)
    with pytest.raises(openai.RateLimitError) as err:
        for _ in range(10):
            client.chat.completions.create(
                model="tiny-chat", messages=CHAT, max_tokens=300, extra_body={"ignore_eos": True}
            )
    assert err.value.code == "rate_limit_exceeded"
    assert err.value.response.headers["x-ratelimit-limit-tokens"] == "400"


def test_request_larger_than_tpm_is_refused_with_a_reason(world: World) -> None:
    _, key = world.tenant(tpm=100)
    with pytest.raises(openai.RateLimitError) as err:
        world.stack.openai(key).chat.completions.create(
            model="tiny-chat", messages=CHAT, max_tokens=500
        )
    assert "Request too large" in err.value.message


def test_concurrency_limit_refuses_at_once(world: World) -> None:
    _, key = world.tenant(max_concurrency=1)
    client = world.stack.openai(key)
    stream = client.chat.completions.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=900,  # long enough to still run when the second request comes
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=1)
    assert time.monotonic() - started < 5  # refused, not queued behind the stream
    assert err.value.code == "rate_limit_exceeded"
    stream.close()
    # The slot comes back when the stream ends (here: the client left).
    wait_for(lambda: _succeeds(client), timeout=10)


def _succeeds(client: openai.OpenAI) -> bool:
    try:
        client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=1)
    except openai.RateLimitError:
        return False
    return True


def test_monthly_token_budget_trips_with_insufficient_quota(world: World) -> None:
    tenant, key = world.tenant(monthly_token_budget=60)
    client = world.stack.openai(key)
    served = 0
    with pytest.raises(openai.RateLimitError) as err:
        for _ in range(10):
            client.chat.completions.create(
                model="tiny-chat", messages=CHAT, max_tokens=20, extra_body={"ignore_eos": True}
            )
            served += 1
    assert err.value.code == "insufficient_quota"
    assert err.value.type == "insufficient_quota"
    wait_for(lambda: len(world.records(tenant=tenant)) == served, timeout=30)
    records = world.records(tenant=tenant)
    used = sum(r.prompt_tokens + r.completion_tokens for r in records)
    assert 60 <= used < 60 + 20 + 20  # stopped by the first request past the budget


def test_monthly_spend_budget_trips_at_the_right_request_and_warns_at_80_percent(
    world: World,
) -> None:
    # $1,000 per 1M tokens = 1,000 micro-dollars a token: each request below costs ~34,000.
    model = Model.objects.get(name="tiny-chat")
    Price.objects.create(
        model=model,
        input_per_mtok=Decimal(1000),
        cached_input_per_mtok=Decimal(1000),
        output_per_mtok=Decimal(1000),
        effective_from=datetime.now(UTC) - timedelta(days=1),
    )
    catalog_everywhere()
    # Three budgets to seed on the first request of the month: tenant tokens and spend, and
    # the key's tokens (generous; the spend budget is the one that trips).
    tenant, key = world.tenant(monthly_spend_budget_micros=60_000, monthly_token_budget=10**9)
    api_key = ApiKey.objects.get(tenant=tenant)
    api_key_limits_update(api_key=api_key, actor=None, limits={"monthly_token_budget": 10**9})
    client = world.stack.openai(key)
    served = 0
    with pytest.raises(openai.RateLimitError) as err:
        for _ in range(10):
            client.chat.completions.create(
                model="tiny-chat", messages=CHAT, max_tokens=20, extra_body={"ignore_eos": True}
            )
            served += 1
    assert err.value.code == "insufficient_quota"
    assert "spend budget" in err.value.message
    wait_for(lambda: len(world.records(tenant=tenant)) == served, timeout=30)
    costs = [r.cost_micros or 0 for r in world.records(tenant=tenant)]
    # Served until the budget was used up, refused from the first request after that.
    assert sum(costs) >= 60_000 > sum(costs[:-1])
    assert all(
        c == (r.prompt_tokens + r.completion_tokens) * 1000
        for c, r in zip(costs, world.records(tenant=tenant), strict=True)
    )
    warning = wait_for(
        lambda: AuditEvent.objects.filter(tenant=tenant, action="budget.warning").first(),
        timeout=30,
    )
    assert warning.details["kind"] == "spend" and warning.details["limit"] == 60_000
    assert warning.details["used"] >= 48_000


# --- Disconnects and metering ----------------------------------------------------------------


def test_client_disconnect_aborts_upstream_and_meters(world: World) -> None:
    tenant, key = world.tenant(max_concurrency=1)
    engine = world.engines[0]
    before = settled_counters(engine)["vllm:generation_tokens_total"]
    # The client gives up 0.3 s into a 1000-token answer (a few seconds of work here).
    started = time.monotonic()
    with httpx.stream(
        "POST",
        f"{world.stack.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "tiny-chat", "messages": CHAT, "max_tokens": 1000, "stream": True,
              "ignore_eos": True},
        timeout=30,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        for _ in response.iter_bytes():
            if time.monotonic() - started > 0.3:
                break
    client = world.stack.openai(key)
    # Concurrency was released: the next request is admitted.
    wait_for(lambda: _succeeds(client), timeout=10)
    record = wait_for(lambda: [r for r in world.records(tenant=tenant) if r.status == "cut_off"])[0]
    generated = settled_counters(engine)["vllm:generation_tokens_total"] - before - 1
    assert generated < 1000  # the engine stopped: the request was aborted
    # Metered: what reached the gateway, never more than the engine made. (Tokens the engine
    # made but had not yet streamed when the client left are the only possible gap.)
    assert 0 < record.completion_tokens <= generated


def test_ledger_equals_engine_counters(world: World) -> None:
    """Every token the engine counted is in the ledger, cut-off streams included."""
    engine = world.engines[0]
    before = settled_counters(engine)
    tenant, key = world.tenant()
    client = world.stack.openai(key)
    for i in range(3):
        client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=10 + i)
        client.completions.create(model="tiny-chat", prompt="Fair queuing", max_tokens=7)
    for cut in (3, 9):  # the client leaves after a few chunks
        stream = client.chat.completions.create(
            model="tiny-chat",
            messages=CHAT,
            max_tokens=40,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i, _ in enumerate(stream):
            if i == cut:
                break
        stream.close()
    records = wait_for(lambda: len(r := world.records(tenant=tenant)) == 8 and r, timeout=30)
    after = settled_counters(engine)
    assert sum(r.prompt_tokens for r in records) == (
        after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    )
    engine_generated = (
        after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    )
    # Exact, except for the one known gap (docs/billing.md, Metering): closing the connection aborts
    # the sequence, and the decode steps in flight at that moment (the running one and the
    # one scheduled behind it) can add tokens that are counted but never streamed, so at
    # most two per cut-off stream (four here). Billing only what the clients read would
    # miss dozens.
    assert 0 <= engine_generated - sum(r.completion_tokens for r in records) <= 4
    # The clients that left early are billed for what the engine made, not what they read.
    assert {r.status for r in records} <= {"ok", "cut_off"}


# --- Coalesced streams --------------------------------------------------------------------


def _written_chunks(url: str, key: str, body: dict[str, Any]) -> list[bytes]:
    """A streamed answer as the gateway wrote it: its HTTP chunks, one per write (read from
    the socket, not through a client that would merge or split them)."""
    host, port = url.removeprefix("http://").split(":")
    payload = orjson.dumps(body)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: %b\r\nauthorization: Bearer %b\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (host.encode(), key.encode(), len(payload), payload)
        )
        data = b""
        while not data.endswith(b"\r\n0\r\n\r\n"):
            got = sock.recv(65536)
            assert got, data
            data += got
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    chunks: list[bytes] = []
    while True:
        size, _, rest = rest.partition(b"\r\n")
        if int(size, 16) == 0:
            return chunks
        chunks.append(rest[: int(size, 16)])
        rest = rest[int(size, 16) + 2 :]


def test_a_crowd_of_streams_is_coalesced_and_loses_nothing_a_stream_alone_is_not(
    engine: Engine, serving_db_url: str, stack_factory: Any
) -> None:
    """INFERPLANE_STREAM_COALESCE_MS, while the web process relays a crowd of streams
    (INFERPLANE_STREAM_COALESCE_FROM_STREAMS, two here): after its first write, a stream is
    written at most once per interval (what the engine sent meanwhile goes out in one write),
    and the answer is the same, token for token, as the non-streamed one, with its usage
    chunk and [DONE]. A stream alone is written as the engine's tokens come."""
    world_rows([engine])
    stack = stack_factory(
        serving_db_url,
        name="coalesce",
        workers=1,  # one process: the crowd is counted per process
        extra_env={
            "INFERPLANE_STREAM_COALESCE_MS": "300",
            "INFERPLANE_STREAM_COALESCE_FROM_STREAMS": "2",
        },
    )
    world = World(stack=stack, engines=[engine])
    _, key = world.tenant()
    args: dict[str, Any] = dict(model="tiny-chat", messages=CHAT, max_tokens=40, temperature=0)
    whole = stack.openai(key).chat.completions.create(**args)
    body = {**args, "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    alone = _written_chunks(stack.url, key, body)
    took = time.monotonic() - started
    # Alone: more writes than a 0.3 s interval would allow (one per token, as they come).
    assert len(alone) > 1 + (took // 0.3 + 1) + 1, (len(alone), took)

    # Beside another stream (of another request, running the whole time): coalesced.
    flowing, stop = threading.Event(), threading.Event()

    def beside() -> None:
        long = {**body, "max_tokens": 1000, "ignore_eos": True}
        with (
            httpx.Client(timeout=60) as client,
            client.stream(
                "POST",
                f"{stack.url}/v1/chat/completions",
                json=long,
                headers={"authorization": f"Bearer {key}"},
            ) as response,
        ):
            for _ in response.iter_raw():
                flowing.set()
                if stop.is_set():
                    return  # closing it aborts the request

    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(beside)
        assert flowing.wait(60), other.exception(timeout=0) if other.done() else "no stream"
        started = time.monotonic()
        chunks = _written_chunks(stack.url, key, body)
        took = time.monotonic() - started
        stop.set()
        other.result(timeout=60)
    events = [e for chunk in chunks for e in chunk.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    parsed = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in parsed if c["choices"])
    assert text == whole.choices[0].message.content
    assert whole.usage is not None
    assert parsed[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens == 40
    # The first write, then at most one per 0.3 s tick the stream spanned, then [DONE]'s.
    assert len(chunks) <= 1 + (took // 0.3 + 1) + 1, (len(chunks), len(events), took)
