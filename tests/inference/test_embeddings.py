"""``POST /v1/embeddings`` through the gateway, on a real embedding engine (the tiny model
served by vLLM's pooling runner, ``--runner pooling --convert embed``, on a pool of its own):
the OpenAI SDK's calls, the engine's own token counts in the ledger at the price book's
price, and each endpoint refusing the models of another task."""

from __future__ import annotations

import io
import math
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import openai
import orjson
import pytest
from django.core.management import call_command

from billing.reconcile import replica_counters_snapshot
from billing.services import price_set
from fleet.models import Model, Replica
from inference.services import model_ensure, pool_configure, pool_ensure, replica_probe
from tests import contract
from tests.engines import ENGINE_HEADERS, Engine
from tests.live import Stack, settled_counters, wait_for
from tests.serving import World, catalog_everywhere, world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CAPACITY = 8  # inputs one replica embeds at once (the pool's max in flight)


@pytest.fixture
def embed_world(
    transactional_db: None, engine: Engine, embed_engine: Engine, gateway_stack: Stack
) -> World:
    world_rows([engine])
    model = model_ensure(
        name="tiny-embed", served_name="tiny-embed", context_length=1024, task=Model.Task.EMBED
    )
    pool = pool_ensure(name="embed", kind="dedicated", model=model, replica_urls=[embed_engine.url])
    pool_configure(pool=pool, max_inflight=CAPACITY)
    for replica in pool.replicas.all():
        replica_probe(replica=replica)
    catalog_everywhere()
    return World(stack=gateway_stack, engines=[engine, embed_engine])


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, abs_tol=1e-3) for x, y in zip(a, b, strict=True)
    )


def test_the_sdk_embeds_through_the_gateway_and_the_ledger_has_the_engine_s_counts(
    embed_world: World,
) -> None:
    tenant, key = embed_world.tenant()
    price_set(
        model=Model.objects.get(name="tiny-embed"),
        input_per_mtok=Decimal(1),  # a micro-dollar a token
        output_per_mtok=Decimal(0),
        actor=None,
    )
    catalog_everywhere()  # the catalog carries prices: the web processes take the new one
    client = embed_world.stack.openai(key)
    texts = ["a cat sat on the mat", "the pool serves many tenants"]
    floats = client.embeddings.create(model="tiny-embed", input=texts, encoding_format="float")
    assert floats.model == "tiny-embed" and [d.index for d in floats.data] == [0, 1]
    vectors = [d.embedding for d in floats.data]
    assert len(vectors[0]) == len(vectors[1]) > 0 and not _close(vectors[0], vectors[1])
    assert all(isinstance(x, float) for x in vectors[0])
    # The SDK asks for base64 unless told otherwise, and decodes it: the same vector.
    packed = client.embeddings.create(model="tiny-embed", input=texts[0])
    assert _close(packed.data[0].embedding, vectors[0])
    tokens = client.embeddings.create(model="tiny-embed", input=[[1, 2, 3, 4]])
    assert tokens.usage.prompt_tokens == 4

    # The engine's own count, straight from it, is what the gateway reports and bills.
    direct = httpx.post(
        f"{embed_world.engines[1].url}/v1/embeddings",
        json={"model": "tiny-embed", "input": texts},
        headers=ENGINE_HEADERS,
        timeout=60,
    ).json()
    assert floats.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert floats.usage.total_tokens == floats.usage.prompt_tokens
    records = wait_for(lambda: len(embed_world.records(tenant=tenant)) == 3, timeout=30)
    assert records
    records = embed_world.records(tenant=tenant)
    assert {(r.endpoint, r.model, r.pool, r.status) for r in records} == {
        ("embeddings", "tiny-embed", "embed", "ok")
    }
    assert sorted(r.prompt_tokens for r in records) == sorted(
        [floats.usage.prompt_tokens, packed.usage.prompt_tokens, 4]
    )
    assert {r.completion_tokens for r in records} == {0}
    assert [r.cost_micros for r in records] == [r.prompt_tokens for r in records]


def test_each_endpoint_takes_only_the_models_of_its_task(embed_world: World) -> None:
    _, key = embed_world.tenant()
    client = embed_world.stack.openai(key)
    listed = {m.id: m.model_dump().get("task") for m in client.models.list()}
    assert listed == {"tiny-chat": "generate", "tiny-embed": "embed"}
    with pytest.raises(openai.BadRequestError) as chat_on_embed:
        client.chat.completions.create(
            model="tiny-embed", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert "is an embedding model" in chat_on_embed.value.message
    with pytest.raises(openai.BadRequestError) as embed_on_chat:
        client.embeddings.create(model="tiny-chat", input="hi", encoding_format="float")
    assert "it makes no embeddings" in embed_on_chat.value.message
    assert embed_on_chat.value.body["param"] == "model"  # type: ignore[index]
    # More inputs than a replica embeds at once: refused, naming the limit.
    with pytest.raises(openai.BadRequestError) as too_many:
        client.embeddings.create(model="tiny-embed", input=["x"] * (CAPACITY + 1))
    assert too_many.value.body["param"] == "input"  # type: ignore[index]
    assert f"at most {CAPACITY}" in too_many.value.message
    refused: list[dict[str, object]] = [
        {"input": ""},
        {"input": []},
        {"input": "hi", "encoding_format": "hex"},
    ]
    for bad in refused:
        response = httpx.post(
            f"{embed_world.stack.url}/v1/embeddings",
            json={"model": "tiny-embed", **bad},
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert response.status_code == 400, bad
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_batch_of_embedding_lines_runs_on_a_spot_pool(embed_world: World) -> None:
    """OpenAI's Batch API takes ``/v1/embeddings`` lines: each answered whole, in the output
    file as OpenAI writes it, billed in batch mode with the engine's counts."""
    tenant, key = embed_world.tenant()
    spot = pool_ensure(
        name="embed-spot",
        kind="spot",
        model=Model.objects.get(name="tiny-embed"),
        replica_urls=[embed_world.engines[1].url],
    )
    for replica in spot.replicas.all():
        replica_probe(replica=replica)
    catalog_everywhere()  # the web processes and the worker take the new pool
    client = openai.OpenAI(api_key=key, base_url=embed_world.stack.url + "/v1", max_retries=0)
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {
                "model": "tiny-embed",
                "input": f"document number {i}",
                "encoding_format": "float",
            },
        }
        for i in range(3)
    ]
    jsonl = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl)), purpose="batch")
    made = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    seen: list[Any] = []

    def finished() -> bool:
        seen.append(client.batches.retrieve(made.id))
        return seen[-1].status in {"completed", "failed", "cancelled", "expired"}

    wait_for(finished, timeout=120, every=0.5)
    batch = seen[-1]
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.request_counts.completed == 3
    assert batch.output_file_id is not None
    output = [
        orjson.loads(x) for x in client.files.content(batch.output_file_id).content.splitlines()
    ]
    assert sorted(o["custom_id"] for o in output) == ["e0", "e1", "e2"]
    for item in output:
        body = item["response"]["body"]
        assert item["response"]["status_code"] == 200 and body["object"] == "list"
        contract.validate("CreateEmbeddingResponse", body)
        assert len(body["data"][0]["embedding"]) > 0
    records = embed_world.records(tenant=tenant)
    assert {(r.endpoint, r.mode, r.pool) for r in records} == {
        ("embeddings", "batch", "embed-spot")
    }
    assert sorted(r.prompt_tokens for r in records) == sorted(
        o["response"]["body"]["usage"]["prompt_tokens"] for o in output
    )


def test_embeddings_reconcile_exactly_with_the_engine(embed_world: World) -> None:
    """Every prompt token the embedding engine counted is in the ledger, and no more: the
    reconciliation of the embed pool is exact."""
    engine = embed_world.engines[1]
    settled_counters(engine)
    start = replica_counters_snapshot(replica=Replica.objects.get(url=engine.url))
    tenant, key = embed_world.tenant()
    client = embed_world.stack.openai(key)
    client.embeddings.create(model="tiny-embed", input="one input", encoding_format="float")
    client.embeddings.create(model="tiny-embed", input=["two", "inputs here"])
    client.embeddings.create(model="tiny-embed", input=list(range(1, 300)))  # one long input
    wait_for(lambda: len(embed_world.records(tenant=tenant)) == 3, timeout=30)
    settled_counters(engine)
    out = io.StringIO()
    since = (start.taken_at + timedelta(milliseconds=1)).isoformat()
    call_command("reconcile_usage", "--pool", "embed", "--since", since, stdout=out)
    header, row = out.getvalue().strip().splitlines()
    reconciled = dict(zip(header.split(","), row.split(","), strict=True))
    assert (reconciled["prompt_diff"], reconciled["records"]) == ("0", "3"), reconciled
    assert reconciled["exact"] == "yes"


def test_a_repeated_embedding_is_answered_from_the_tenants_cache(embed_world: World) -> None:
    """The same inputs again: the stored vectors, no engine, billed as a hit (no tokens)."""
    from tenants.services import tenant_cache_update

    tenant, key = embed_world.tenant()
    tenant_cache_update(tenant=tenant, actor=None, mode="exact")
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": "tiny-embed", "input": ["a cat sat", "on the mat"], "encoding_format": "float"}

    def embed() -> httpx.Response:
        answer = httpx.post(
            f"{embed_world.stack.url}/v1/embeddings", json=body, headers=headers, timeout=60
        )
        assert answer.status_code == 200, answer.text
        return answer

    first, again = embed(), embed()
    assert (first.headers["x-inferplane-cache"], again.headers["x-inferplane-cache"]) == (
        "miss",
        "hit",
    )
    assert again.json()["data"] == first.json()["data"]
    assert again.json()["usage"] == first.json()["usage"]
    wait_for(lambda: len(embed_world.records(tenant=tenant)) == 2, timeout=30)
    by_status = {r.status: r for r in embed_world.records(tenant=tenant)}
    made, hit = by_status["ok"], by_status["cache_hit"]
    assert made.prompt_tokens == first.json()["usage"]["prompt_tokens"] > 0
    assert (hit.prompt_tokens, hit.replica) == (0, "")


def _vector(world: World, key: str, text: str) -> list[float]:
    answer = httpx.post(
        f"{world.stack.url}/v1/embeddings",
        json={"model": "tiny-embed", "input": text, "encoding_format": "float"},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return list(answer.json()["data"][0]["embedding"])


def test_the_semantic_cache_answers_a_close_text_inside_the_tenants_partition_only(
    embed_world: World,
) -> None:
    from tenants.services import tenant_cache_update

    # The tiny model embeds most texts alike (its weights are designed to write, not to
    # mean): two different texts it puts together, and one it puts far from them. What the
    # test checks is the cache's rule on the similarities the engine gives, measured here.
    said, close, far = (
        "Tell me about the cache.",
        "Describe the cache.",
        "the pool serves many tenants",
    )
    _, plain = embed_world.tenant()
    vectors = [_vector(embed_world, plain, text) for text in (said, close, far)]

    def cosine(a: list[float], b: list[float]) -> float:
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    similarity, distance = cosine(vectors[0], vectors[1]), cosine(vectors[0], vectors[2])
    assert similarity >= 0.96 and distance < 0.9  # the texts the test is designed on
    semantic: dict[str, Any] = {"mode": "semantic", "embedding_model": "tiny-embed"}
    tenant, key = embed_world.tenant()
    tenant_cache_update(tenant=tenant, actor=None, threshold=0.95, **semantic)
    other, other_key = embed_world.tenant()
    tenant_cache_update(tenant=other, actor=None, threshold=0.5, **semantic)

    def chat(key: str, text: str, system: str = "") -> httpx.Response:
        messages = [{"role": "system", "content": system}] if system else []
        body = {
            "model": "tiny-chat",
            "messages": [*messages, {"role": "user", "content": text}],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        answer = httpx.post(
            f"{embed_world.stack.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        return answer

    first = chat(key, said)
    assert first.headers["x-inferplane-cache"] == "miss"
    hit = chat(key, close)
    assert hit.headers["x-inferplane-cache"] == "hit"
    assert math.isclose(
        float(hit.headers["x-inferplane-cache-similarity"]), similarity, abs_tol=2e-3
    )
    assert hit.json()["choices"] == first.json()["choices"]
    # Far in meaning: a miss, told how close the best one came.
    missed = chat(key, far)
    assert missed.headers["x-inferplane-cache"] == "miss"
    assert math.isclose(
        float(missed.headers["x-inferplane-cache-similarity"]), distance, abs_tol=2e-3
    )
    # Another tenant, the same words, a lower threshold: its own partition, empty.
    theirs = chat(other_key, close)
    assert theirs.headers["x-inferplane-cache"] == "miss"
    assert "x-inferplane-cache-similarity" not in theirs.headers
    # Another system prompt: another partition.
    assert chat(key, close, system="Be brief.").headers["x-inferplane-cache"] == "miss"
    # The ledger: the engine's answers, the hit with no tokens, each lookup's embedding the
    # tenant's own embeddings request (made each time: a lookup's vector is kept with the
    # answer, not in the exact cache).
    wait_for(lambda: len(embed_world.records(tenant=tenant)) == 8, timeout=30)
    records = embed_world.records(tenant=tenant)
    assert sorted((r.endpoint, r.status) for r in records) == sorted(
        [("chat.completions", "ok")] * 3
        + [("chat.completions", "cache_hit")]
        + [("embeddings", "ok")] * 4
    )
