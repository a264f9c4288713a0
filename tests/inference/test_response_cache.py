"""The response cache on a real engine, as tenants use it and as another tenant would try
it: a repeated request answered from the tenant's own store over JSON, SSE and WebSocket
(each a valid OpenAI answer: the contract checker reads every one), billed as a hit; another
tenant never gets it, whatever it sends; what changes the answer misses; what cannot be
cached is passed by with the reason; a word banned after caching is cut on replay; a purge
empties it, for the tenant's own managers only.

The tiny model's answers are designed (``devkit.tiny_model``: token k of every chat answer is
``word_at(k)``), so every answer's text is known before it runs."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from django.urls import reverse

from billing.models import UsageRecord
from devkit.tiny_model import answer as scripted
from tenants.models import Role, Tenant
from tenants.services import api_key_cache_update, api_key_create, tenant_cache_update
from tests.conftest import client_for
from tests.factories import MembershipFactory, UserFactory
from tests.inference.test_websocket import _until_end, _ws
from tests.live import wait_for
from tests.moderation import test_moderation as moderation
from tests.serving import World

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

TOKENS = 8
BODY: dict[str, Any] = {
    "model": "tiny-chat",
    "messages": [{"role": "user", "content": "Tell me about the cache."}],
    "max_tokens": TOKENS,
    "temperature": 0,
    "ignore_eos": True,
}


def _cached_tenant(world: World) -> tuple[Tenant, str]:
    tenant, key = world.tenant()
    tenant_cache_update(tenant=tenant, actor=None, mode="exact", ttl_seconds=600)
    return tenant, key


def _post(world: World, key: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    response = httpx.post(
        f"{world.stack.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}", **headers},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response


def _stream(world: World, key: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The cache header and the chunks of one streamed answer (read to its [DONE])."""
    chunks: list[dict[str, Any]] = []
    with httpx.stream(
        "POST",
        f"{world.stack.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        lines = list(response.iter_lines())
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return response.headers["x-inferplane-cache"], chunks


def _text(answer: httpx.Response) -> str:
    return str(answer.json()["choices"][0]["message"]["content"])


def _records(world: World, tenant: Tenant, count: int) -> list[UsageRecord]:
    found: list[UsageRecord] = wait_for(
        lambda: len(r := world.records(tenant=tenant)) >= count and r, timeout=30
    )
    assert len(found) == count
    # In the order the requests began: the drains may write one after the next one's.
    return sorted(found, key=lambda record: record.started_at)


def test_a_repeat_is_answered_from_the_tenants_own_cache_and_billed_as_a_hit(
    world: World,
) -> None:
    tenant, key = _cached_tenant(world)
    first = _post(world, key, BODY)
    assert first.headers["x-inferplane-cache"] == "miss"
    assert _text(first) == scripted(TOKENS)
    engine_usage = first.json()["usage"]

    # The same request again, whole, streamed and over the WebSocket: the stored answer.
    again = _post(world, key, BODY)
    assert again.headers["x-inferplane-cache"] == "hit"
    assert _text(again) == scripted(TOKENS)
    assert again.json()["choices"][0]["finish_reason"] == "length"
    assert again.json()["usage"] == engine_usage  # what the answer took to make
    assert again.json()["id"] != first.json()["id"]
    header, chunks = _stream(world, key, BODY)
    assert header == "hit"
    deltas = [
        c["choices"][0]["delta"].get("content")
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    assert "".join(deltas) == scripted(TOKENS) and len(deltas) > 1  # it streams, in pieces
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"] == engine_usage
    with _ws(world, key) as ws:
        ws.send(json.dumps({"type": "request", "id": "w", "body": BODY}))
        messages = _until_end(ws, "w")
    assert messages[-1]["type"] == "done" and messages[-1]["cache"] == "hit"
    words = [m["data"]["choices"][0]["delta"].get("content") or "" for m in messages[:-1]]
    assert "".join(words) == scripted(TOKENS)

    # The ledger: the engine's tokens once; each hit a record of its own, no tokens, no cost.
    records = _records(world, tenant, 4)
    made = [r for r in records if r.status == "ok"]
    hits = [r for r in records if r.status == "cache_hit"]
    assert len(made) == 1 and made[0].completion_tokens == TOKENS
    assert len(hits) == 3
    assert all(
        (r.prompt_tokens, r.completion_tokens, r.cost_micros or 0, r.replica) == (0, 0, 0, "")
        for r in hits
    )


def test_another_tenant_never_gets_it_whatever_it_sends(world: World) -> None:
    _, key_a = _cached_tenant(world)
    other, key_b = _cached_tenant(world)
    _post(world, key_a, BODY)
    assert _post(world, key_a, BODY).headers["x-inferplane-cache"] == "hit"
    # The identical request, with every header and field a client could forge.
    forged = _post(
        world,
        key_b,
        BODY,
        **{"x-inferplane-cache": "hit", "cache-control": "only-if-cached", "x-tenant": "1"},
    )
    assert forged.headers["x-inferplane-cache"] == "miss"
    (record,) = _records(world, other, 1)
    assert record.status == "ok" and record.completion_tokens == TOKENS  # the engine ran


def test_what_changes_the_answer_misses_and_what_cannot_be_cached_is_passed_by(
    world: World,
) -> None:
    tenant, key = _cached_tenant(world)
    _post(world, key, BODY)
    system = [{"role": "system", "content": "Be brief."}, *BODY["messages"]]
    tool = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}
    for changed in (
        {"messages": system},
        {"tools": [tool], "tool_choice": "none"},
        {"seed": 7},
        {"max_tokens": 7},
    ):
        outcome = _post(world, key, {**BODY, **changed}).headers["x-inferplane-cache"]
        assert outcome == "miss", changed
    assert _post(world, key, BODY).headers["x-inferplane-cache"] == "hit"

    def passed(body: dict[str, Any], **headers: str) -> tuple[str, str]:
        answer = _post(world, key, body, **headers)
        return answer.headers["x-inferplane-cache"], answer.headers.get(
            "x-inferplane-cache-reason", ""
        )

    sampled = {**BODY, "temperature": 0.8, "top_k": 1}
    assert passed(sampled) == ("bypass", "sampled")
    # Asked for: a sampled request is kept and answered from the cache.
    assert passed(sampled, **{"x-inferplane-cache": "sampled"}) == ("miss", "")
    assert passed(sampled, **{"x-inferplane-cache": "sampled"}) == ("hit", "")
    assert passed(BODY, **{"cache-control": "no-store"}) == ("bypass", "no-store")
    assert passed({**BODY, "logprobs": True}) == ("bypass", "logprobs")
    # no-cache: the engine answers, and its answer is kept.
    fresh = {**BODY, "max_tokens": 5}
    assert passed(fresh, **{"cache-control": "no-cache"}) == ("miss", "")
    assert passed(fresh) == ("hit", "")
    # A key kept out of its tenant's cache passes it by.
    apart = api_key_create(tenant=tenant, name="apart", created_by=None)
    api_key_cache_update(api_key=apart.api_key, actor=None, enabled=False)
    assert passed(BODY) == ("hit", "")
    assert _post(world, apart.secret, BODY).headers["x-inferplane-cache-reason"] == "key"
    # A tenant without the cache: no header at all.
    _, plain = world.tenant()
    assert "x-inferplane-cache" not in _post(world, plain, BODY).headers


def test_a_word_banned_after_caching_is_cut_on_replay(world: World) -> None:
    tenant, key = _cached_tenant(world)
    body = moderation._body()
    chunks, done = moderation._sse(world, key, body)
    assert done and "".join(moderation._texts(chunks)[0]) == moderation.TEXT
    moderation._ban(world, tenant, key, moderation.TERM, output_mode="hold")
    chunks, done = moderation._sse(world, key, body)
    # The replay comes as one batch: the guard holds it all and, finding the word, releases
    # none of the windows it checked with it (as for an engine that sent it all in one read).
    text = "".join(moderation._texts(chunks).get(0, []))
    assert moderation.TERM not in text and moderation._finish(chunks) == {0: "content_filter"}
    whole = _post(world, key, body)
    assert whole.headers["x-inferplane-cache"] == "hit"
    assert whole.json()["choices"][0]["finish_reason"] == "content_filter"
    assert moderation.TERM not in _text(whole)
    statuses = [r.status for r in _records(world, tenant, 3)]
    assert statuses == ["ok", "content_filter", "content_filter"]


def test_a_purge_empties_the_tenants_cache_for_its_managers_only(world: World) -> None:
    tenant, key = _cached_tenant(world)
    _post(world, key, BODY)
    assert _post(world, key, BODY).headers["x-inferplane-cache"] == "hit"
    url = reverse("inference:tenant-cache-purge", kwargs={"slug": tenant.slug})
    outsider = UserFactory.create()
    MembershipFactory.create(user=outsider, tenant=world.tenant()[0], role=Role.OWNER)
    assert client_for(outsider).post(url).status_code == 404
    developer = MembershipFactory.create(tenant=tenant, role=Role.DEVELOPER).user
    assert client_for(developer).post(url).status_code == 403
    assert _post(world, key, BODY).headers["x-inferplane-cache"] == "hit"
    owner = MembershipFactory.create(tenant=tenant, role=Role.OWNER).user
    purged = client_for(owner).post(url)
    assert purged.status_code == 200 and purged.json() == {"purged": 1}
    assert _post(world, key, BODY).headers["x-inferplane-cache"] == "miss"
    # Turned off and on again: what it held before is gone too.
    assert _post(world, key, BODY).headers["x-inferplane-cache"] == "hit"
    tenant_cache_update(tenant=tenant, actor=None, mode="off")
    wait_for(lambda: "x-inferplane-cache" not in _post(world, key, BODY).headers, timeout=10)
    tenant_cache_update(tenant=tenant, actor=None, mode="exact")
    first = wait_for(lambda: _post(world, key, BODY).headers.get("x-inferplane-cache"), timeout=10)
    assert first == "miss"
