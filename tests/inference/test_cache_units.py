"""The response cache's parts that need no engine: what a request's key is made of, what it
passes by, the replayed stream's shape (OpenAI's chunk schema), and the per-tenant bounds of
the store in a real Redis."""

from __future__ import annotations

from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from django.test import override_settings

from controlplane.redis import redis_sync
from inference.gateway import cache, cache_semantic, replay
from inference.gateway.auth import KeyInfo
from inference.gateway.schema import parse_request
from tests.contract import STREAMED_COMPLETION, validate

BASE: dict[str, Any] = {
    "model": "tiny-chat",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "temperature": 0,
    "max_tokens": 8,
}


def _key(tenant: int = 1, policy: str = "exact", model: str = "e") -> KeyInfo:
    return KeyInfo(
        1, "p", "d", tenant, f"t{tenant}", 1, frozenset(), None, (), (), (policy, 60, 0.9, model)
    )


def _ticket(
    body: dict[str, Any] | None = None,
    *,
    key: KeyInfo | None = None,
    asked: cache.Directives | None = None,
    endpoint: str = "chat.completions",
    mode: str = "online",
    max_tokens: int | None = None,
) -> cache.Ticket:
    body = body or BASE
    parsed = parse_request(orjson.dumps(body), endpoint)
    max_tokens = max_tokens or body.get("max_tokens")
    found = cache.ticket(
        key or _key(),
        parsed,
        version="tiny-chat|tiny-chat|1",
        max_tokens=max_tokens,
        asked=asked,
        mode=mode,
    )
    assert found is not None
    return found


def test_the_key_is_the_tenant_and_the_whole_request_but_not_how_it_is_carried() -> None:
    base = _ticket()
    assert base.outcome == "miss" and base.read and base.store
    # The same request streamed, or with its fields in another order: the same answer.
    streamed = _ticket({**BASE, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.digest == base.digest
    assert _ticket({**BASE, "service_tier": "flex"}).digest == base.digest  # another class
    assert _ticket(dict(reversed(list(BASE.items())))).digest == base.digest
    # Another tenant never shares it; anything that changes the answer changes the key.
    assert _ticket(key=_key(tenant=2)).digest != base.digest
    system = [{"role": "system", "content": "Be long."}, BASE["messages"][1]]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for changed in (
        {"messages": system},
        {"tools": [tool]},
        {"max_tokens": 9},
        {"seed": 3},
        {"stop": ["x"]},
        {"response_format": {"type": "json_object"}},
        {"user": "someone"},
    ):
        assert _ticket({**BASE, **changed}).digest != base.digest, changed
    # The limit the engine is sent is the key's cap when that is lower: another answer.
    assert _ticket(max_tokens=4).digest != base.digest
    # A tenant without the cache has no ticket: no header, no lookup.
    parsed = parse_request(orjson.dumps(BASE), "chat.completions")
    off = cache.ticket(_key(policy="off"), parsed, version="v", max_tokens=8, asked=None, mode="")
    assert off is None


@pytest.mark.parametrize(
    ("change", "asked", "reason"),
    [
        ({"temperature": None}, None, "sampled"),
        ({"temperature": 0.7}, None, "sampled"),
        ({"top_p": 0.9}, None, "sampled"),
        ({"temperature": 0.7, "n": 2}, cache.Directives(sampled=True), "sampled-n"),
        ({"logprobs": True}, None, "logprobs"),
        ({"prompt_logprobs": 0}, None, "logprobs"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                    }
                ]
            },
            None,
            "multimodal",
        ),
        ({}, cache.Directives(read=False, store=False), "no-store"),
    ],
)
def test_what_the_cache_passes_by(
    change: dict[str, Any], asked: cache.Directives | None, reason: str
) -> None:
    body = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    ticket = _ticket(body, asked=asked)
    assert (ticket.outcome, ticket.reason) == ("bypass", reason)
    assert not ticket.read and not ticket.store
    assert (b"x-inferplane-cache-reason", reason.encode()) in ticket.headers()


def test_a_sampled_request_is_cached_when_the_caller_asks() -> None:
    ticket = _ticket({**BASE, "temperature": 0.7}, asked=cache.Directives(sampled=True))
    assert ticket.outcome == "miss" and ticket.store


def test_a_key_kept_out_of_its_tenants_cache_passes_it_by() -> None:
    assert _ticket(key=_key(policy="key-off")).reason == "key"


def test_odd_but_valid_bodies_are_passed_by_not_a_500() -> None:
    # A completion's logprobs=0 still returns logprobs (a replay would not).
    completion = {"model": "m", "prompt": "hi", "temperature": 0, "logprobs": 0}
    assert _ticket(completion, endpoint="completions").reason == "logprobs"
    # A number sent as a string (the schema takes it) is read as one.
    assert _ticket({**BASE, "temperature": "0"}).outcome == "miss"
    # Nested as deep as orjson writes (255 levels, as the engine's body is): still hashed.
    depth = 255 - 6  # the body, tools, a tool, its function, its parameters, "d"
    parameters = b'{"d": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    raw = orjson.dumps({**BASE, "tool_choice": "none"})[:-1] + (
        b', "tools": [{"type": "function", "function": {"name": "f", "parameters": '
        + parameters
        + b"}}]}"
    )
    parsed = parse_request(raw, "chat.completions")
    deep = cache.ticket(_key(), parsed, version="v", max_tokens=8, asked=None, mode="online")
    assert deep is not None and deep.outcome == "miss" and deep.digest


def test_batch_lines_are_not_cached_and_embeddings_are() -> None:
    assert _ticket(mode="batch").reason == "batch"
    embed = {"model": "e", "input": ["hi", "there"]}
    ticket = _ticket(embed, endpoint="embeddings")
    assert ticket.outcome == "miss"
    assert _ticket({**embed, "encoding_format": "base64"}, endpoint="embeddings").digest != (
        ticket.digest
    )
    one = {"object": "embedding", "embedding": [0.5]}
    cache.keep_embeddings(ticket, {"data": [{**one, "index": 0}], "usage": {}})
    assert not ticket.kept  # one vector of two
    cache.keep_embeddings(ticket, {"data": [{**one, "index": 0}, {**one, "index": 1}], "usage": {}})
    assert ticket.kept


def test_headers_ask_the_cache() -> None:
    assert cache.directives(None, None) == cache.Directives()
    assert cache.directives(b"no-cache", None) == cache.Directives(read=False)
    assert cache.directives(b"max-age=0, No-Store", None) == cache.Directives(False, False)
    assert cache.directives(None, b" Sampled ").sampled


def test_only_answers_that_ended_as_asked_are_kept() -> None:
    def kept(finish: str, **body: Any) -> bool:
        ticket = _ticket({**BASE, **body})
        cache.keep(ticket, {"choices": [{"index": 0, "finish_reason": finish}], "usage": {}})
        return bool(ticket.kept)

    assert kept("stop") and kept("tool_calls") and kept("length")
    # Cut by a limit the caller did not set (the context's end): not what was asked.
    assert not kept("length", max_tokens=None)
    assert not kept("content_filter") and not kept("abort")
    empty = _ticket()
    cache.keep(empty, {"choices": [], "usage": {}})
    assert not empty.kept  # an answer without its choice
    with override_settings(INFERPLANE_RESPONSE_CACHE_MAX_ENTRY_BYTES=1024):
        ticket = _ticket()
        cache.keep(
            ticket,
            {"choices": [{"index": 0, "finish_reason": "stop", "text": "x" * 2000}], "usage": {}},
        )
        assert not ticket.kept  # too large to keep


@pytest.mark.parametrize("chat", [True, False])
def test_a_replayed_stream_has_openais_chunk_shape(chat: bool) -> None:
    text = " one two three four five six seven eight nine"
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "finish_reason": "stop",
        }
        tool = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        second = {
            "index": 1,
            "message": {"role": "assistant", "content": None, "tool_calls": [tool]},
            "finish_reason": "tool_calls",
        }
        entry = {"choices": [choice, second], "usage": {"prompt_tokens": 3}}
    else:
        entry = {"choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
    created = int(datetime.now(UTC).timestamp())
    chunks = replay.replay_chunks(
        entry, chat=chat, rid="r1", created=created, model="tiny-chat", null_usage=chat
    )
    component = "CreateChatCompletionStreamResponse" if chat else STREAMED_COMPLETION
    for chunk in chunks:
        validate(component, chunk)
    key = "delta" if chat else None
    texts = [
        (c["choices"][0][key].get("content") if key else c["choices"][0]["text"]) or ""
        for c in chunks
        if c["choices"][0]["index"] == 0
    ]
    assert "".join(texts) == text and len([t for t in texts if t]) == 9  # a word an event
    if chat:
        calls = [c["choices"][0]["delta"].get("tool_calls") for c in chunks]
        assert [{"index": 0, **tool}] in calls
        assert [c["choices"][0]["finish_reason"] for c in chunks].count("tool_calls") == 1


def test_the_store_keeps_each_tenant_within_its_entries_and_bytes() -> None:
    client: Any = redis_sync()
    tenant = 987_654
    prefix = cache.prefix(tenant)
    client.eval(cache.PURGE.source, 1, prefix)

    def store(digest: str, size: int, *, entries: int = 3, total: int = 10_000) -> None:
        client.eval(cache.STORE.source, 1, prefix, digest, "x" * size, 60_000, entries, total)

    for digest in "abcd":
        store(digest, 100)
    held = {h.decode() for h in client.zrange(prefix + "idx", 0, -1)}
    assert held == {"b", "c", "d"}  # the least recently used left first
    assert client.get(prefix + "e:a") is None and int(client.get(prefix + "bytes")) == 300
    # A hit is used: the entry not hit since goes first.
    assert client.eval(cache.LOOKUP.source, 1, prefix, "b", 60_000) == b"x" * 100
    store("e", 100)
    assert {h.decode() for h in client.zrange(prefix + "idx", 0, -1)} == {"b", "d", "e"}
    # Bytes bound it too; an answer larger than them all is not kept.
    store("f", 250, total=400)
    assert int(client.get(prefix + "bytes")) <= 400
    assert client.eval(cache.STORE.source, 1, prefix, "g", "x" * 500, 60_000, 3, 400) == -1
    # A TTL lowered since: an answer older than it is not served, and leaves the books.
    assert client.eval(cache.LOOKUP.source, 1, prefix, "f", 0) is None
    assert client.zscore(prefix + "at", "f") is None and client.get(prefix + "e:f") is None
    # The books never expire before the answers they count (a purge finds them all).
    store("h", 10)
    client.eval(cache.STORE.source, 1, prefix, "i", "x", 1_000, 3, 10_000)
    assert client.pttl(prefix + "idx") > 50_000
    # Another tenant's store is another partition; a purge takes everything of one tenant.
    other = cache.prefix(tenant + 1)
    client.eval(cache.STORE.source, 1, other, "a", "y", 60_000, 3, 10_000)
    assert client.eval(cache.PURGE.source, 1, prefix) >= 1
    assert client.keys(prefix + "*") == []
    assert client.get(other + "e:a") == b"y"
    client.eval(cache.PURGE.source, 1, other)


def _semantic_ticket(body: dict[str, Any], tenant: int = 1) -> cache.Ticket:
    return _ticket(body, key=_key(tenant=tenant, policy="semantic"))


def test_single_turn_requests_get_a_partition_of_all_but_their_text() -> None:
    ticket = _semantic_ticket(BASE)
    assert ticket.semantic is not None and ticket.semantic.text == "Hi"
    assert (ticket.semantic.threshold, ticket.semantic.model) == (0.9, "e")
    other_text = {**BASE, "messages": [BASE["messages"][0], {"role": "user", "content": "Yo"}]}
    other = _semantic_ticket(other_text)
    assert other.semantic is not None
    assert other.semantic.partition == ticket.semantic.partition  # compared with each other
    assert other.digest != ticket.digest
    # Anything else about the request is another partition: never compared.
    system = {**BASE, "messages": [{"role": "system", "content": "Be long."}, BASE["messages"][1]]}
    for changed in (system, {**BASE, "max_tokens": 9}, {**BASE, "seed": 1}):
        found = _semantic_ticket(changed).semantic
        assert found is not None and found.partition != ticket.semantic.partition
    assert _semantic_ticket(BASE, tenant=2).semantic.partition != ticket.semantic.partition  # type: ignore[union-attr]
    other_model = _ticket(BASE, key=_key(policy="semantic", model="m")).semantic
    assert other_model is not None and other_model.partition != ticket.semantic.partition
    # Not single-turn, or not one text: exact only.
    turns = [
        *BASE["messages"],
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "y"},
    ]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert _semantic_ticket({**BASE, "messages": turns}).semantic is None
    assert _semantic_ticket({**BASE, "messages": parts}).semantic is not None
    assert _ticket(BASE).semantic is None  # an exact cache


async def test_a_similar_text_finds_its_answer_inside_its_partition_only() -> None:
    from inference.gateway.redis import redis_async

    client = redis_async()
    tenant, other = 987_700, 987_701
    for t in (tenant, other):
        await client.eval(cache.PURGE.source, 1, cache.prefix(t))
    ticket = _semantic_ticket(BASE, tenant=tenant)
    semantic = ticket.semantic
    assert semantic is not None
    stored = {
        "a": cache_semantic.unit_vector([1.0, 0.0, 0.0]),
        "b": cache_semantic.unit_vector([0.0, 1.0, 0.0]),
    }
    for digest, vector in stored.items():
        answer = orjson.dumps({"choices": [{"index": 0, "text": digest}]})
        await client.eval(
            cache.STORE.source, 1, cache.prefix(tenant), digest, answer, 60_000, 10, 10**6,
            semantic.partition, vector.tobytes(),
        )  # fmt: skip
    near_b = cache_semantic.unit_vector([0.1, 1.0, 0.0])
    await cache_semantic.lookup_similar(ticket, near_b)
    assert ticket.hit and ticket.entry == {"choices": [{"index": 0, "text": "b"}]}
    assert semantic.similarity is not None and 0.99 < semantic.similarity < 1.0
    assert (b"x-inferplane-cache-similarity", f"{semantic.similarity:.4f}".encode()) in (
        ticket.headers()
    )
    # Below the threshold: a miss, with the best similarity said.
    far = _semantic_ticket(BASE, tenant=tenant)
    await cache_semantic.lookup_similar(far, cache_semantic.unit_vector([1.0, 1.0, 1.0]))
    assert not far.hit and far.semantic is not None and far.semantic.similarity < 0.9  # type: ignore[operator]
    # Another tenant, the same partition name: nothing of the first's.
    theirs = _semantic_ticket(BASE, tenant=other)
    await cache_semantic.lookup_similar(theirs, near_b)
    assert not theirs.hit and theirs.semantic is not None and theirs.semantic.similarity is None
    # A purge empties the partition, and every process's copy of it follows.
    await client.eval(cache.PURGE.source, 1, cache.prefix(tenant))
    again = _semantic_ticket(BASE, tenant=tenant)
    await cache_semantic.lookup_similar(again, near_b)
    assert not again.hit
    assert [k async for k in client.scan_iter(match=cache.prefix(tenant) + "*")] == [
        (cache.prefix(tenant) + f"so:{semantic.partition}").encode()
    ]  # the log's offset alone, moved past every copy (they fetch the partition whole)
    await client.delete(cache.prefix(tenant) + f"so:{semantic.partition}")


async def test_every_web_process_copy_follows_the_partition_through_any_change() -> None:
    """Two processes' copies (each its own ``_mirrors``) through stores, evictions, a log
    compacted under them and a purge: after each look, a copy holds exactly the partition's
    vectors, and the best match is the brute-force one."""
    import random

    import numpy as np

    from inference.gateway.redis import redis_async

    client: Any = redis_async()
    tenant = 987_800
    base = cache.prefix(tenant)
    await client.eval(cache.PURGE.source, 1, base)
    ticket = _semantic_ticket(BASE, tenant=tenant)
    assert ticket.semantic is not None
    partition = ticket.semantic.partition
    draw = random.Random(3)
    copies: list[Any] = [cache_semantic._mirrors, OrderedDict()]
    held: dict[str, Any] = {}

    async def look(process: int) -> None:
        cache_semantic._mirrors = copies[process]
        query = cache_semantic.unit_vector([draw.uniform(-1, 1) for _ in range(4)])
        mirror = await cache_semantic._mirror(tenant, partition, 4)
        stored = await client.hgetall(f"{base}s:{partition}")
        assert set(mirror.digests) == {d.decode() for d in stored}
        found = mirror.best(query)
        if stored:
            brute = max(stored, key=lambda d: float(np.frombuffer(stored[d], np.float32) @ query))
            assert found is not None and found[0] == brute.decode()

    try:
        for step in range(1300):  # past the log's 1,000 + twice the partition: compacted
            digest = f"d{draw.randrange(40)}"
            vector = cache_semantic.unit_vector([draw.uniform(-1, 1) for _ in range(4)])
            answer = orjson.dumps({"choices": [{"index": 0}]})
            await client.eval(
                cache.STORE.source, 1, base, digest, answer, 60_000, 12, 10**6,
                partition, vector.tobytes(),
            )  # fmt: skip
            held[digest] = vector
            if step % 7 == 0:
                await look(0)
            if step % 97 == 0:
                await look(1)
            if step == 650:
                await client.eval(cache.PURGE.source, 1, base)
                await look(0)
        assert int(await client.get(f"{base}so:{partition}")) > 0  # the log was dropped
        await look(0)
        await look(1)
    finally:
        cache_semantic._mirrors = copies[0]
        await client.eval(cache.PURGE.source, 1, base)
        await client.delete(f"{base}so:{partition}")
