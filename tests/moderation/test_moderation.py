"""Moderation on a live stack (web, worker, beat) in front of the real tiny vLLM engine: a
word the tiny model's script writes at a known token (devkit.tiny_model), banned, cuts the
answer there over SSE, WebSocket and non-streamed, for n > 1 too; a banned word in the
prompt never gets an answer; flag and log leave the answer alone and record events; a policy
change applies within two seconds; a guard that fails follows fail-open or fail-closed;
``/v1/moderations`` through the ``openai`` SDK."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from billing.models import UsageRecord
from controlplane.redis import redis_sync
from devkit.tiny_model import CYCLE, RUNNER_UP, word_at
from devkit.tiny_model import answer as scripted
from fleet.models import Model, Replica
from inference.catalog import pool_prefix
from inference.services import model_ensure, pool_ensure, replica_probe
from moderation.categories import CATEGORIES
from moderation.models import ModerationEvent
from moderation.services import moderation_events_flush, moderation_policy_set
from tenants.models import Tenant
from tests.batches.test_batches import _client as batch_client
from tests.batches.test_batches import _content as batch_content
from tests.batches.test_batches import _create as batch_create
from tests.batches.test_batches import _finished as finished
from tests.batches.test_batches import _line as batch_line
from tests.batches.test_batches import _until as batch_until
from tests.batches.test_batches import _upload as batch_upload
from tests.batches.test_batches import spot  # noqa: F401  (fixture)
from tests.inference.test_websocket import _until_end, _ws
from tests.live import settled_counters, wait_for
from tests.serving import World, policies_everywhere, world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

PROMPT = [{"role": "user", "content": "Tell me a long story about the sea."}]
TOKENS = 60  # the answer a test asks for: the script's words 0-59
LONG = 600  # what a cut request asks for: the engine must be stopped well before
WINDOW = 8
OVERLAP = 4
# The banned word: the one the script writes as token AT of every chat answer (its first
# appearance: the cycle's words are all different), two windows in.
AT = 18
TERM = word_at(AT)
assert CYCLE.index(TERM) == AT and AT >= 2 * WINDOW
TEXT = scripted(TOKENS)


def _body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny-chat",
        "messages": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def _sse(world: World, key: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The chunks of one streamed answer, and whether it ended with ``[DONE]``."""
    chunks, done = [], False
    with httpx.stream(
        "POST",
        f"{world.stack.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json=body | {"stream": True},
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    return chunks, done


def _texts(chunks: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Each choice's deltas, in order (one per token the engine streamed)."""
    out: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                out.setdefault(choice["index"], []).append(content)
    return out


def _finish(chunks: list[dict[str, Any]]) -> dict[int, str]:
    return {
        c["index"]: c["finish_reason"]
        for chunk in chunks
        for c in chunk.get("choices") or ()
        if c.get("finish_reason")
    }


def _deltas(chunks: list[dict[str, Any]], index: int = 0) -> list[tuple[str, int]]:
    """Choice ``index``'s deltas as (text, tokens in it): with ``logprobs`` on, each delta
    lists one entry per token (the engine merges steps into one delta when it runs ahead)."""
    out = []
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if choice["index"] == index and content:
                out.append((content, len((choice.get("logprobs") or {}).get("content") or ())))
    return out


def _policy(tenant: Tenant, **changes: Any) -> None:
    changes.setdefault("classifier", False)  # the tiny model's words are not profane
    changes.setdefault("window_tokens", WINDOW)
    changes.setdefault("overlap_tokens", OVERLAP)
    moderation_policy_set(tenant=tenant, changes=changes, actor=None)


def _record(world: World, tenant: Tenant, count: int = 1) -> list[UsageRecord]:
    records: list[UsageRecord] = wait_for(
        lambda: len(r := world.records(tenant=tenant)) >= count and r, timeout=30
    )
    return records


def _events(tenant: Tenant, count: int = 1) -> list[ModerationEvent]:
    def found() -> list[ModerationEvent] | None:
        moderation_events_flush()
        events = list(ModerationEvent.objects.filter(tenant=tenant).order_by("id"))
        return events if len(events) >= count else None

    result: list[ModerationEvent] = wait_for(found, timeout=20)
    return result


@dataclass
class Banned:
    """A tenant, its key, the model's answer (TOKENS tokens), the word to ban and the token
    where it first starts."""

    tenant: Tenant
    key: str
    text: str = TEXT
    term: str = TERM
    at: int = AT


@pytest.fixture
def banned(world: World) -> Banned:
    tenant, key = world.tenant()
    return Banned(tenant, key)


def _twice(**extra: Any) -> dict[str, Any]:
    """Two choices of the same greedy answer: vLLM refuses n > 1 at temperature 0, and
    sampling from the top token alone is the same thing."""
    return _body(n=2, temperature=1.0, top_k=1, **extra)


def _sdk(**body: Any) -> dict[str, Any]:
    """A body as the openai SDK takes it (vLLM's extras under extra_body)."""
    extra = {k: body.pop(k) for k in ("ignore_eos", "top_k") if k in body}
    return body | {"extra_body": extra}


def _ban(world: World, tenant: Tenant, key: str, term: str, **changes: Any) -> None:
    _policy(tenant, deny_terms=[term], **changes)
    policies_everywhere()


@pytest.mark.under_load
def test_hold_mode_never_lets_the_banned_word_reach_the_client(
    world: World, banned: Banned
) -> None:
    tenant = banned.tenant
    key = banned.key
    text = banned.text
    term = banned.term
    _ban(world, tenant, key, term, output_mode="hold")
    engine = world.engines[0]
    before = settled_counters(engine)
    chunks, done = _sse(world, key, _body(max_tokens=LONG, stream_options={"include_usage": True}))
    delivered = "".join(_texts(chunks).get(0, []))
    assert done and _finish(chunks) == {0: "content_filter"}
    assert term.lower() not in delivered.lower()
    assert text.startswith(delivered)  # what came is the answer, up to the cut
    usage = chunks[-1]["usage"]
    record = _record(world, tenant)[-1]
    after = settled_counters(engine)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert record.status == "content_filter"
    assert usage["completion_tokens"] == record.completion_tokens
    # Billed for what the engine made (it was aborted and reported its own final count), not
    # for what the client was shown: the held window was never sent.
    shown = len(delivered.split())  # every token of the script is one word
    assert delivered == scripted(shown)
    assert record.completion_tokens > AT >= shown
    assert record.completion_tokens == generated
    assert record.completion_tokens < LONG // 2  # the engine was stopped
    event = _events(tenant)[0]
    assert (event.where, event.action, event.rules) == ("output", "block", ["deny_term"])
    assert event.text == ""  # no text unless the tenant opts in


def _offered(chunks: list[dict[str, Any]]) -> list[set[str]]:
    """Each token's alternatives as ``top_logprobs`` showed them, streamed or whole."""
    out = []
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            logprobs = choice.get("logprobs") or {}
            for entry in logprobs.get("content") or ():  # chat
                out.append({top["token"] for top in entry["top_logprobs"]})
            for tops in logprobs.get("top_logprobs") or ():  # completions
                out.append(set(tops))
    return out


@pytest.mark.under_load
def test_hold_mode_checks_the_alternatives_logprobs_show(world: World, banned: Banned) -> None:
    """The tiny model's runner-up at every token is a word its answers never write
    (devkit.tiny_model.RUNNER_UP): ``top_logprobs`` shows it beside each token. Banned, it
    ends the answer in hold mode before any alternative reaches the client."""
    runner_up = " " + RUNNER_UP
    _, free = world.tenant()  # no policy: the alternatives as they are
    chunks, _ = _sse(world, free, _body(max_tokens=8, logprobs=True, top_logprobs=2))
    offered = _offered(chunks)
    assert len(offered) == 8 and all(runner_up in tops for tops in offered)
    assert RUNNER_UP not in "".join(_texts(chunks)[0])
    _ban(world, banned.tenant, banned.key, RUNNER_UP, output_mode="hold")
    chunks, done = _sse(world, banned.key, _body(logprobs=True, top_logprobs=2))
    assert done and _finish(chunks) == {0: "content_filter"}
    assert not any(runner_up in tops for tops in _offered(chunks))
    # A completion's alternatives (the legacy ``logprobs: 2``), not streamed.
    response = httpx.post(
        f"{world.stack.url}/v1/completions",
        headers={"authorization": f"Bearer {banned.key}"},
        json={"model": "tiny-chat", "prompt": "Tell", "max_tokens": 16, "logprobs": 2},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] == "content_filter"
    assert not any(runner_up in tops for tops in _offered([answer]))


@pytest.mark.under_load
def test_async_mode_cuts_within_one_window(world: World, banned: Banned) -> None:
    tenant = banned.tenant
    key = banned.key
    text = banned.text
    term = banned.term
    at = banned.at
    _ban(world, tenant, key, term, output_mode="async")
    chunks, done = _sse(world, key, _body(logprobs=True))
    deltas = _deltas(chunks)
    delivered = sum(count for _, count in deltas)
    assert done and _finish(chunks) == {0: "content_filter"}
    assert text.startswith("".join(t for t, _ in deltas))
    # Async: tokens flow at once, and the cut comes at most one window after the word
    # began (the word itself may or may not have gone out, by where the window fell).
    assert delivered - at <= WINDOW


@pytest.mark.under_load
def test_non_streamed_and_n_2_are_cut_too(world: World, banned: Banned) -> None:
    tenant = banned.tenant
    key = banned.key
    term = banned.term  # every choice writes the script: n > 1 changes no word
    _ban(world, tenant, key, term, output_mode="hold")
    client = world.stack.openai(key)
    answer = client.chat.completions.create(**_sdk(**_twice()))
    texts = [c.message.content for c in answer.choices]
    assert [c.finish_reason for c in answer.choices] == ["content_filter"] * 2, (term, texts)
    for choice in answer.choices:
        given = choice.message.content or ""
        assert term.lower() not in given.lower() and TEXT.startswith(given)
    record = _record(world, tenant)[-1]
    assert record.status == "content_filter"
    assert answer.usage is not None and answer.usage.completion_tokens == record.completion_tokens
    # Streamed with n=2: each choice is cut where it writes the word, and delivers none of it.
    chunks, done = _sse(world, key, _twice())
    assert done and _finish(chunks) == {0: "content_filter", 1: "content_filter"}
    for deltas in _texts(chunks).values():
        assert term.lower() not in "".join(deltas).lower() and TEXT.startswith("".join(deltas))


@pytest.mark.under_load
def test_the_websocket_is_cut_the_same_way(world: World, banned: Banned) -> None:
    tenant = banned.tenant
    key = banned.key
    term = banned.term
    _ban(world, tenant, key, term, output_mode="hold")
    with _ws(world, key) as ws:
        ws.send(json.dumps({"type": "request", "id": "m1", "body": _body()}))
        messages = _until_end(ws, "m1")
    chunks = [m["data"] for m in messages if m["type"] == "chunk"]
    assert messages[-1]["type"] == "done"
    assert _finish(chunks) == {0: "content_filter"}
    assert term.lower() not in "".join(_texts(chunks).get(0, [])).lower()


@pytest.mark.under_load
def test_a_banned_word_in_the_prompt_is_never_sent_to_the_engine(
    world: World, banned: Banned
) -> None:
    """The rules run before the request is sent (tens of microseconds): a prompt they block
    costs the engine nothing, and the ledger says so (before, it ran beside the prefill: the
    engine prefilled what the ledger billed as 0 prompt tokens)."""
    tenant = banned.tenant
    key = banned.key
    term = banned.term
    _ban(world, tenant, key, term)
    engine = world.engines[0]
    before = settled_counters(engine)
    prompt = [{"role": "user", "content": f"Please write about {term} for a while."}]
    response = httpx.post(
        f"{world.stack.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json=_body(messages=prompt, max_tokens=800, stream=True),
        timeout=60,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "content_policy_violation"
    assert error["type"] == "invalid_request_error"
    record = _record(world, tenant)[-1]
    after = settled_counters(engine)
    assert record.status == "content_filter"
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
    for counter in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert after[counter] == before[counter], counter  # the ledger equals the engine
    event = _events(tenant)[0]
    assert (event.where, event.action) == ("input", "block")


def test_a_banned_prompt_is_refused_at_once_in_a_full_pool(world: World, banned: Banned) -> None:
    """The rules run before admission: with the pool full (one slot, held by another
    tenant's answer that its stopped engine does not finish), a prompt they block is refused
    without waiting for the slot, and takes none (before, it queued behind the other tenant
    and got its 400 only once the slot came free)."""
    _ban(world, banned.tenant, banned.key, banned.term)
    holder, holder_key = world.tenant()
    world_rows(world.engines, max_inflight=1, max_queue_wait_seconds=60)
    engine = world.engines[0]
    redis = redis_sync()
    active = pool_prefix("online") + "active"
    done = threading.Event()

    def hold() -> None:
        body = _body(max_tokens=LONG, stream=True)
        headers = {"authorization": f"Bearer {holder_key}"}
        with httpx.stream(
            "POST", f"{world.stack.url}/v1/chat/completions", json=body, headers=headers,
            timeout=120,
        ) as response:  # fmt: skip
            next(response.iter_lines())
            done.wait(timeout=120)

    thread = threading.Thread(target=hold)
    # The engine stops before the holder asks: its answer cannot end on its own, however fast
    # the engine (stopped after the first line, a 600-token answer had already finished in CI).
    os.killpg(engine.process.pid, signal.SIGSTOP)
    thread.start()
    try:
        # the pool's one slot is the holder's (admission takes it before the engine answers)
        wait_for(lambda: redis.hget(active, str(holder.pk)) == b"1", timeout=30)
        prompt = [{"role": "user", "content": f"Please write about {banned.term}."}]
        response = httpx.post(
            f"{world.stack.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {banned.key}"},
            json=_body(messages=prompt, max_tokens=8),
            timeout=30,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "content_policy_violation"
        # Answered while the holder still held the slot, and without taking one.
        assert redis.hget(active, str(holder.pk)) == b"1"
        assert redis.hget(active, str(banned.tenant.pk)) in (None, b"0")
    finally:
        os.killpg(engine.process.pid, signal.SIGCONT)
        done.set()
        thread.join(timeout=60)
        world_rows(world.engines, max_inflight=8, max_queue_wait_seconds=30)
    record = _record(world, banned.tenant)[-1]
    assert record.status == "content_filter" and record.replica == ""
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)


def test_flag_and_log_record_events_and_leave_the_answer_alone(
    world: World, banned: Banned
) -> None:
    tenant = banned.tenant
    key = banned.key
    text = banned.text
    term = banned.term
    _ban(world, tenant, key, term, action="flag")
    chunks, _ = _sse(world, key, _body(stream_options={"include_usage": True}))
    assert "".join(_texts(chunks)[0]) == text and _finish(chunks) == {0: "length"}
    shown = [c for c in chunks if "moderation" in c]
    assert len(shown) == 1 and shown[0]["choices"] == []  # a chunk of its own, as OpenAI's
    assert shown[0] is chunks[-2] and "usage" not in shown[0]  # before the usage chunk
    output = shown[0]["moderation"]["output"]["results"][0]
    assert output["flagged"] is True and sorted(output["categories"]) == sorted(CATEGORIES)
    assert shown[0]["moderation"]["input"]["results"][0]["flagged"] is False
    answer = world.stack.openai(key).chat.completions.create(**_sdk(**_body()))
    assert answer.choices[0].message.content == text
    # The SDK reads it as OpenAI's own moderated completion.
    assert answer.moderation is not None and answer.moderation.output.type == "moderation_results"
    assert answer.moderation.output.results[0].flagged is True

    _policy(tenant, action="log", store_text=True)
    policies_everywhere()
    chunks, _ = _sse(world, key, _body())
    assert "".join(_texts(chunks)[0]) == text and not any("moderation" in c for c in chunks)
    events = _events(tenant, 3)
    assert [e.action for e in events] == ["flag", "flag", "log"]
    assert term.lower() in events[-1].text.lower()  # opted in: the window that fired
    assert {r.status for r in _record(world, tenant, 3)} == {"ok"}


def test_a_policy_change_applies_within_two_seconds(world: World) -> None:
    tenant, key = world.tenant()
    term = TERM
    prompt = [{"role": "user", "content": f"About {term}."}]
    body = _body(messages=prompt, max_tokens=1)

    def refused() -> bool:
        r = httpx.post(
            f"{world.stack.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json=body,
            timeout=30,
        )
        return r.status_code == 400

    assert not refused()
    _policy(tenant, deny_terms=[term])
    changed = time.monotonic()
    wait_for(refused, timeout=10, every=0.1)
    assert time.monotonic() - changed < 2.5
    _policy(tenant, enabled=False)
    changed = time.monotonic()
    wait_for(lambda: not refused(), timeout=10, every=0.1)
    assert time.monotonic() - changed < 2.5


def _broken_guard(world: World) -> None:
    """A guard model whose only replica is a real engine that cannot classify (the chat
    engine: its /classify is not there), so every guard call fails."""
    model = model_ensure(
        name="broken-guard", served_name="tiny-chat", context_length=1024, task=Model.Task.CLASSIFY
    )
    pool = pool_ensure(
        name="guard", kind="dedicated", model=model, replica_urls=[world.engines[0].url]
    )
    for replica in pool.replicas.all():
        replica_probe(replica=replica)
        assert Replica.objects.get(pk=replica.pk).state == Replica.State.READY
    from inference.catalog import catalog_publish

    catalog_publish()


def test_a_failing_guard_fails_open_or_closed_as_the_policy_says(world: World) -> None:
    _broken_guard(world)
    tenant, key = world.tenant()
    client = world.stack.openai(key)
    _policy(tenant, guard_model="broken-guard", fail_open=False)
    policies_everywhere()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**_sdk(**_body(max_tokens=4)))
    assert refused.value.code == "content_policy_violation"
    assert "could not be checked" in refused.value.message

    _policy(tenant, guard_model="broken-guard", fail_open=True)
    policies_everywhere()
    answer = client.chat.completions.create(**_sdk(**_body(max_tokens=4)))
    assert answer.choices[0].finish_reason == "length"
    events = _events(tenant, 2)
    assert events[0].action == "block" and "broken-guard" in events[0].failure
    assert events[-1].action == "log" and "broken-guard" in events[-1].failure


def test_moderations_endpoint_through_the_sdk(world: World) -> None:
    tenant, key = world.tenant()
    client = world.stack.openai(key)
    result = client.moderations.create(input=["you stupid idiot", "the sea is calm today"])
    assert result.id.startswith("modr-") and len(result.results) == 2
    rude, calm = result.results
    assert rude.flagged and rude.categories.harassment
    assert rude.category_scores.harassment > 0.8
    assert not calm.flagged and calm.category_scores.harassment < 0.2
    assert rude.category_applied_input_types.harassment == ["text"]
    assert rude.category_applied_input_types.violence == []
    assert set(rude.categories.model_dump(by_alias=True)) == set(CATEGORIES)
    parts = client.moderations.create(input=[{"type": "text", "text": "the sea is calm"}])  # type: ignore[arg-type]
    assert not parts.results[0].flagged
    # The tenant's own rules apply.
    _policy(tenant, deny_terms=["lighthouse"], classifier=True)
    policies_everywhere()
    ruled = client.moderations.create(input="a lighthouse by the sea")
    assert ruled.results[0].flagged
    records = _record(world, tenant, 3)
    assert {(r.endpoint, r.status, r.completion_tokens) for r in records} == {
        ("moderations", "ok", 0)
    }


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"input": 5},
        {"input": []},
        {"input": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
        {"input": "x", "surprise": True},
    ],
)
def test_malformed_moderations_input_gets_openais_400(world: World, body: dict[str, Any]) -> None:
    _, key = world.tenant()
    response = httpx.post(
        f"{world.stack.url}/v1/moderations",
        headers={"authorization": f"Bearer {key}"},
        json=body,
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_moderations_needs_a_key(world: World) -> None:
    response = httpx.post(f"{world.stack.url}/v1/moderations", json={"input": "hi"}, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.under_load
def test_batch_lines_are_moderated_the_same_way(spot: World, banned: Banned) -> None:  # noqa: F811
    tenant, key, text, term = banned.tenant, banned.key, banned.text, banned.term
    _ban(spot, tenant, key, term, output_mode="hold")
    client = batch_client(spot, key)
    answer_line = batch_line("cut", content=PROMPT[0]["content"], max_tokens=TOKENS)
    answer_line["body"] |= {"ignore_eos": True}
    lines = [answer_line, batch_line("refused", content=f"Write about {term} now.")]
    batch = batch_until(client, batch_create(client, batch_upload(client, lines)).id, finished)
    assert batch.status == "completed", batch
    (cut,) = batch_content(client, batch.output_file_id)
    choice = cut["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "content_filter"
    assert text.startswith(choice["message"]["content"])
    assert term.lower() not in choice["message"]["content"].lower()
    (refused,) = batch_content(client, batch.error_file_id)
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["code"] == "content_policy_violation"
    records = {r.request_id: r for r in _record(spot, tenant, 2)}
    billed = records[cut["response"]["request_id"]]
    assert (billed.mode, billed.status) == ("batch", "content_filter")
    assert billed.completion_tokens == cut["response"]["body"]["usage"]["completion_tokens"]


def test_card_numbers_and_ibans_count_only_when_their_checksum_holds(world: World) -> None:
    tenant, key = world.tenant()
    _policy(tenant, pii_action="block")
    policies_everywhere()
    for number, blocked in [
        ("4111 1111 1111 1111", True),  # Luhn holds
        ("4111 1111 1111 1112", False),  # an order number of card length
        ("GB82 WEST 1234 5698 7654 32", True),  # mod-97 holds
        ("GB82 WEST 1234 5698 7654 33", False),
    ]:
        prompt = [{"role": "user", "content": f"Please charge {number} today."}]
        response = httpx.post(
            f"{world.stack.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json=_body(messages=prompt, max_tokens=2),
            timeout=60,
        )
        assert response.status_code == (400 if blocked else 200), (number, response.text)


def test_masked_pii_never_reaches_the_engine(world: World) -> None:
    tenant, key = world.tenant()
    _policy(tenant, pii_action="mask")
    policies_everywhere()
    response = httpx.post(
        f"{world.stack.url}/v1/completions",
        headers={"authorization": f"Bearer {key}"},
        # echo: the engine answers with the prompt as it received it
        json={"model": "tiny-chat", "prompt": "card 4111 1111 1111 1111 and 1234567890123456",
              "max_tokens": 1, "echo": True},
        timeout=60,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    seen = response.json()["choices"][0]["text"]
    assert seen.startswith("card [card_number] and 1234567890123456")
    assert "4111" not in seen
    events = _events(tenant)
    assert events[0].rules == ["pii:card_number"] and events[0].action == "log"
