"""The seams other legs plug into (inference.gateway.seams): an output filter, an input check and
a run without an HTTP request on a pool given by name — driven in-process, as their users
(moderation, the batch worker) will drive them, against the session's real vLLM engine, real
Redis and Postgres. The ledger is read after the spool's own flush (billing.spool)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from asgiref.sync import async_to_sync

from billing.models import UsageRecord
from billing.spool import usage_spool_flush
from inference.catalog import catalog_publish
from inference.gateway.admission import queue_state
from inference.gateway.auth import KeyInfo, key_info_from_db
from inference.gateway.call import State
from inference.gateway.errors import ApiError
from inference.gateway.headless import run_whole
from inference.gateway.lifecycle import Lifecycle
from inference.gateway.redis import redis_async
from inference.gateway.schema import ParsedRequest
from inference.gateway.seams import PassThrough, Screened
from inference.gateway.upstream import engine_session
from inference.gateway.v1 import SSE_DONE, sse_frame
from tenants.models import Tenant
from tenants.services import api_key_create, tenant_create
from tests import contract
from tests.engines import Engine
from tests.live import settled_counters
from tests.serving import spot_pool, world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CHUNK = "CreateChatCompletionStreamResponse"
_slugs = itertools.count(1)


def _chat(max_tokens: int, **extra: Any) -> bytes:
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return orjson.dumps(body)


STREAMED = {"stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Serving:
    engine: Engine

    def tenant(self, **limits: int | None) -> tuple[Tenant, KeyInfo]:
        """A tenant and its key as the gateway knows it, loaded the way a worker that holds
        a batch's key (not its secret) loads it."""
        tenant = tenant_create(slug=f"seam-{next(_slugs)}", weight=1, limits=limits, actor=None)
        issued = api_key_create(tenant=tenant, name="test", created_by=None)
        key = key_info_from_db(issued.api_key.prefix)
        assert key is not None
        return tenant, key

    def records(self, tenant: Tenant) -> list[UsageRecord]:
        usage_spool_flush()  # what the worker's periodic flush does
        return list(UsageRecord.objects.filter(tenant=tenant).order_by("id"))


@pytest.fixture
def serving(transactional_db: None, engine: Engine) -> Serving:
    """The online pool of the live tests, and a spot pool of the same model on the same
    engine (batch lines' pool)."""
    world_rows([engine])
    spot_pool([engine])
    catalog_publish()
    return Serving(engine=engine)


def _closing[**P, T](fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """``fn``, then the event loop's shared clients closed (its loop ends after it)."""

    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        finally:
            await engine_session().close()
            await redis_async().aclose()

    return call


def run[T](scenario: Callable[[], Awaitable[T]]) -> T:
    """Run a scenario on an event loop of its own, as sync code (a Celery task) would."""
    return asyncio.run(_closing(scenario)())


def _events(body: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, ``[DONE]`` as the string."""
    events = [e for e in body.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events), events
    return [e[6:].decode() if e == SSE_DONE.strip() else orjson.loads(e[6:]) for e in events]


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(
        c["delta"].get("content") or "" for chunk in chunks for c in chunk.get("choices") or ()
    )


def _finishes(chunks: list[dict[str, Any]]) -> list[str]:
    return [
        c["finish_reason"]
        for chunk in chunks
        for c in chunk.get("choices") or ()
        if c.get("finish_reason")
    ]


async def _streamed(key: KeyInfo, body: bytes, **seams: Any) -> bytes:
    """What the SSE transport writes after its headers, for one request."""
    life = await Lifecycle.begin(key=key, raw_body=body, endpoint="chat.completions", **seams)
    async with life:
        await life.start()
        return b"".join([sse_frame(batch) async for batch in life]) + SSE_DONE


class CutAfter:
    """Releases text until ``limit`` characters, then cuts (as a moderation hold would)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen = 0

    async def screen(self, batch: list[dict[str, Any]]) -> Screened:
        released: list[dict[str, Any]] = []
        for chunk in batch:
            self.seen += len(_text([chunk]))
            if self.seen > self.limit:
                return Screened(released, cut="the answer broke the policy")
            released.append(chunk)
        return Screened(released)

    async def end(self) -> Screened:
        return Screened([])


# --- The output filter -------------------------------------------------------------------------


def test_a_filter_that_cuts_ends_the_stream_with_content_filter(serving: Serving) -> None:
    tenant, key = serving.tenant()
    before = settled_counters(serving.engine)

    async def scenario() -> bytes:
        return await _streamed(key, _chat(400, **STREAMED), output_filter=CutAfter(20))

    events = _events(run(scenario))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        contract.validate(CHUNK, chunk)
    # Nothing past the cut reached the client (a loaded engine can send many tokens in one
    # chunk, the first one past the limit already: then nothing at all is released).
    assert len(_text(chunks)) <= 20
    assert _finishes(chunks) == ["content_filter"]
    usage = chunks[-1]["usage"]  # the usage chunk closes the answer, as asked for
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] > 0

    after = settled_counters(serving.engine)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    (record,) = serving.records(tenant)
    assert record.status == "content_filter"
    assert record.completion_tokens < 400  # the engine stopped: vLLM aborted the sequence
    assert record.completion_tokens == usage["completion_tokens"]
    assert record.prompt_tokens == usage["prompt_tokens"] > 0
    assert 0 <= generated - record.completion_tokens <= 4  # what the engine made is billed


def test_a_filter_that_cuts_a_whole_answer_finishes_it_with_content_filter(
    serving: Serving,
) -> None:
    tenant, key = serving.tenant()

    async def scenario() -> tuple[int, dict[str, Any]]:
        return await run_whole(
            key=key, raw_body=_chat(400), endpoint="chat.completions", output_filter=CutAfter(20)
        )

    status, body = run(scenario)
    assert status == 200
    contract.validate("CreateChatCompletionResponse", body)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "content_filter"
    assert len(choice["message"]["content"]) <= 20  # (none, if the first chunk was past it)
    (record,) = serving.records(tenant)
    assert record.status == "content_filter"
    assert record.completion_tokens == body["usage"]["completion_tokens"] < 400


def test_a_pass_through_filter_changes_nothing(serving: Serving) -> None:
    tenant, key = serving.tenant()

    async def scenario() -> tuple[bytes, bytes]:
        plain = await _streamed(key, _chat(24, **STREAMED))
        filtered = await _streamed(key, _chat(24, **STREAMED), output_filter=PassThrough())
        return plain, filtered

    plain, filtered = (_events(body) for body in run(scenario))

    def comparable(events: list[Any]) -> tuple[Any, ...]:
        # The same answer, but another request: its own id, time and (maybe) cached prefix;
        # and the engine may split the same text into deltas differently (it merges steps
        # when it runs ahead of its stream), so the text is compared, not the deltas.
        chunks = [e for e in events if isinstance(e, dict)]
        text = "".join(
            c["delta"].get("content") or "" for e in chunks for c in e["choices"] if "delta" in c
        )
        usage = [{**e["usage"], "prompt_tokens_details": None} for e in chunks if e.get("usage")]
        shape = {frozenset(e) for e in chunks}  # every chunk's fields, as OpenAI's
        return text, _finishes(events[:-1]), usage, shape, events[-1]

    assert comparable(filtered) == comparable(plain)
    assert _finishes(plain[:-1]) == ["length"] and plain[-2]["usage"]["completion_tokens"] == 24
    records = serving.records(tenant)
    assert [(r.status, r.completion_tokens) for r in records] == [("ok", 24), ("ok", 24)]


# --- The input check -------------------------------------------------------------------------


def test_an_input_check_that_refuses_answers_400_and_bills_only_what_was_made(
    serving: Serving,
) -> None:
    tenant, key = serving.tenant()
    before = settled_counters(serving.engine)
    released: list[list[dict[str, Any]]] = []

    async def refuse(request: ParsedRequest, key: KeyInfo) -> str | None:
        return "This input is not allowed here."

    async def scenario() -> ApiError:
        life = await Lifecycle.begin(
            key=key,
            raw_body=_chat(400, **STREAMED),
            endpoint="chat.completions",
            input_check=refuse,
        )
        with pytest.raises(ApiError) as refused:
            async with life:
                await life.start()
                released.extend([batch async for batch in life])
        return refused.value

    error = run(scenario)
    assert not released  # nothing was sent before the refusal
    assert (error.status, error.code, error.type) == (
        400,
        "content_policy_violation",
        "invalid_request_error",
    )
    contract.validate("ErrorResponse", error.body())
    after = settled_counters(serving.engine)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 400  # the engine's request was closed, not run to its end
    (record,) = serving.records(tenant)
    assert record.status == "content_filter"
    assert record.completion_tokens <= generated  # never billed beyond what was made
    assert (
        record.prompt_tokens
        <= after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    )


def test_an_input_check_that_refuses_late_bills_what_the_engine_made(serving: Serving) -> None:
    """A check slower than the engine's first token: the tokens made meanwhile are billed."""
    tenant, key = serving.tenant()
    before = settled_counters(serving.engine)
    answered = asyncio.Event()

    async def scenario() -> tuple[int, dict[str, Any]]:

        async def refuse_after_first_token(request: ParsedRequest, key: KeyInfo) -> str | None:
            await _engine_running(serving.engine)
            await asyncio.sleep(0.3)  # the engine keeps generating meanwhile
            answered.set()
            return "This input is not allowed here."

        return await run_whole(
            key=key,
            raw_body=_chat(400),
            endpoint="chat.completions",
            input_check=refuse_after_first_token,
        )

    status, body = run(scenario)
    assert answered.is_set()
    assert status == 400 and body["error"]["code"] == "content_policy_violation"
    after = settled_counters(serving.engine)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    (record,) = serving.records(tenant)
    assert record.status == "content_filter"
    assert 0 < record.completion_tokens < 400
    assert generated == record.completion_tokens  # the engine aborted, then reported its count


async def _engine_running(engine: Engine) -> bool:
    """Wait until the engine runs a request (its own gauge); TimeoutError if it never does."""
    async with httpx.AsyncClient(timeout=5) as client, asyncio.timeout(20):
        while True:
            text = (await client.get(f"{engine.url}/metrics")).text
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_running") and float(line.split()[-1]) >= 1:
                    return True
            await asyncio.sleep(0.05)


def test_a_slow_input_check_overlaps_the_upstream_request(serving: Serving) -> None:
    tenant, key = serving.tenant()
    seen: dict[str, Any] = {}
    released: list[list[dict[str, Any]]] = []

    async def scenario() -> bytes:
        life: Lifecycle | None = None

        async def slow_check(request: ParsedRequest, key: KeyInfo) -> str | None:
            assert life is not None
            seen["engine answered when the check began"] = life.call.state is not State.PREPARED
            try:
                seen["engine ran while the check ran"] = await _engine_running(serving.engine)
            except TimeoutError:
                seen["engine ran while the check ran"] = False
            seen["chunks released before the check finished"] = len(released)
            return None

        life = await Lifecycle.begin(
            key=key,
            raw_body=_chat(400, **STREAMED),
            endpoint="chat.completions",
            input_check=slow_check,
        )
        async with life:
            await life.start()
            async for batch in life:
                released.append(batch)
        return b"".join(sse_frame(batch) for batch in released) + SSE_DONE

    events = _events(run(scenario))
    assert seen == {
        "engine answered when the check began": False,
        "engine ran while the check ran": True,
        "chunks released before the check finished": 0,
    }
    assert _finishes(events[:-1]) == ["length"] and events[-1] == "[DONE]"
    (record,) = serving.records(tenant)
    assert (record.status, record.completion_tokens) == ("ok", 400)


# --- A request without an HTTP request, on a pool given by name ------------------------------


def test_run_whole_from_sync_code_on_a_pool_given_by_name(serving: Serving) -> None:
    tenant, key = serving.tenant(max_concurrency=1)

    # From a synchronous caller, as a Celery task: async_to_sync, then asyncio.run in a thread.
    first = async_to_sync(_closing(run_whole))(
        key=key, raw_body=_chat(8), endpoint="chat.completions", pool="spot"
    )

    async def second() -> tuple[int, dict[str, Any]]:
        return await run_whole(
            key=key, raw_body=_chat(8, **STREAMED), endpoint="chat.completions", pool="spot"
        )

    with ThreadPoolExecutor(1) as thread:
        # Its concurrency limit is 1: this passes only if the first gave its lease back.
        again = thread.submit(run, second).result(timeout=120)

    for status, body in (first, again):
        assert status == 200
        contract.validate("CreateChatCompletionResponse", body)
        assert body["object"] == "chat.completion" and body["model"] == "tiny-chat"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 8
    records = serving.records(tenant)
    assert [(r.pool, r.status, r.mode, r.completion_tokens) for r in records] == [
        ("spot", "ok", "online", 8),
        ("spot", "ok", "online", 8),
    ]
    assert records[0].prompt_tokens == first[1]["usage"]["prompt_tokens"] > 0
    assert records[0].replica  # routed to the spot pool's replica
    # Nothing is left held on the pool: no sequence in flight, no tenant running.
    state = queue_state("spot")
    assert set(state.in_flight.values()) == {0} and not state.running and not state.queued
    assert not queue_state("online").running  # the online pool was never used


def test_run_whole_answers_errors_in_openai_shape(serving: Serving) -> None:
    tenant, key = serving.tenant()

    async def scenario() -> list[tuple[int, dict[str, Any]]]:
        return [
            await run_whole(
                key=key, raw_body=_chat(8), endpoint="chat.completions", pool="no-such-pool"
            ),
            await run_whole(key=key, raw_body=b"{", endpoint="chat.completions", pool="spot"),
        ]

    (missing, broken) = run(scenario)
    assert missing[0] == 503 and missing[1]["error"]["code"] == "no_pool"
    assert broken[0] == 400 and broken[1]["error"]["type"] == "invalid_request_error"
    for _, body in (missing, broken):
        contract.validate("ErrorResponse", body)
    assert serving.records(tenant) == []  # refused before the engine: nothing to bill
