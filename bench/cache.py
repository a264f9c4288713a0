"""The response cache (docs/cache.md), measured against the same engine and gateway in the
same run: what it saves and what it costs.

One chat engine and the gateway in front of it (two web processes, as ``make run``); two
tenants, one with the exact cache on and one without.

1. **Engine tokens saved**: the same workload of greedy requests, 30% of them repeats of an
   earlier one (a fixed draw), from 4 clients: first as the tenant without the cache, then as
   the tenant with it. The engine's own counters (prompt + generation tokens) for each; goal:
   >= 25% fewer with the cache.
2. **A hit's TTFT**: streamed requests the cache holds, one at a time; goal p50 <= 5 ms.
3. **What a miss adds**: streamed requests never seen before, one at a time, alternating
   between the tenant with the cache (each a miss: a lookup, then the answer recorded and
   kept) and the one without; goal <= 1 ms added to TTFT at p50.
4. **The semantic lookup at 10,000 entries**: one tenant's partition filled with 10,000
   stored answers and their vectors (random unit vectors of ``--dims``), then lookups of
   random vectors as the gateway makes them (the partition's changes since the process's
   copy last read it, one round trip; the product; the answer's fetch on a hit); goal p99
   <= 2 ms. Then the same while the partition changes: a store before every lookup (the
   copy takes the change, not the partition). The embedding of the request's text is not
   part of it (an embeddings request of its own).

    .venv/bin/python -m bench.cache [--requests 300] [--samples 100] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from typing import Any

import aiohttp

from bench.harness import ROOT, Bench, django_setup, percentile, seed, tenant_key

REPEAT_SHARE = 0.3


def _engine_tokens(engine: str) -> float:
    """Prompt plus generation tokens the engine has counted so far."""
    import httpx

    text = httpx.get(f"{engine}/metrics", timeout=10).text
    total = 0.0
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        total += sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))
    return total


def _body(prompt: str, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def workload(requests: int, seed_value: int = 7) -> list[str]:
    """``requests`` prompts, REPEAT_SHARE of them (exactly) an earlier one again."""
    draw = random.Random(seed_value)
    repeats = set(draw.sample(range(1, requests), round(requests * REPEAT_SHARE)))
    prompts: list[str] = []
    for i in range(requests):
        if i in repeats:
            prompts.append(draw.choice(prompts))
        else:
            prompts.append(f"Question {i}: tell me about item {draw.randrange(10**9)}.")
    return prompts


async def _whole(session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]) -> str:
    async with session.post(url, json=body, headers={"authorization": f"Bearer {key}"}) as r:
        await r.read()
        r.raise_for_status()
        return r.headers.get("x-inferplane-cache", "")


async def _ttft(session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    ttft = 0.0
    async with session.post(url, json=body, headers={"authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for line in r.content:
            if not ttft and line.startswith(b"data: {"):
                ttft = time.perf_counter() - started
    return ttft * 1000


async def run(args: argparse.Namespace, engine: str, gateway: str, keys: dict[str, str]) -> Any:
    url = f"{gateway}/v1/chat/completions"
    prompts = workload(args.requests)
    results: dict[str, Any] = {"repeats": len(prompts) - len(set(prompts))}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for name in ("off", "on"):  # warm both paths
            await _whole(session, url, keys[name], _body("warm up", 4, stream=False))
        tokens: dict[str, float] = {}
        outcomes: dict[str, int] = {}
        for name in ("off", "on"):
            queue = list(prompts)
            before = _engine_tokens(engine)

            async def client(name: str = name, queue: list[str] = queue) -> None:
                while queue:
                    prompt = queue.pop(0)
                    body = _body(prompt, args.max_tokens, stream=False)
                    outcome = await _whole(session, url, keys[name], body)
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1

            await asyncio.gather(*(client() for _ in range(4)))
            tokens[name] = _engine_tokens(engine) - before
        results["engine_tokens"] = tokens
        results["outcomes_with_cache"] = outcomes
        results["tokens_ratio"] = tokens["on"] / tokens["off"]

        # A hit's TTFT: the first prompt of the workload is held now.
        held = _body(prompts[0], args.max_tokens, stream=True)
        hits = [await _ttft(session, url, keys["on"], held) for _ in range(args.samples)]
        # A miss against no cache at all, alternating.
        ttft: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(args.samples):
            for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
                body = _body(f"Never seen {name} {i}", 4, stream=True)
                ttft[name].append(await _ttft(session, url, keys[name], body))
    results["hit_ttft_ms"] = {f"p{q}": percentile(hits, q) for q in (50, 90, 99)}
    results["miss_ttft_ms"] = {
        name: {f"p{q}": percentile(v, q) for q in (50, 90)} for name, v in ttft.items()
    }
    results["miss_added_p50_ms"] = percentile(ttft["on"], 50) - percentile(ttft["off"], 50)
    return results


async def semantic_lookup(entries: int, dims: int, lookups: int) -> dict[str, Any]:
    import numpy as np

    from inference.gateway import cache, cache_semantic
    from inference.gateway.auth import KeyInfo
    from inference.gateway.redis import redis_async
    from inference.gateway.schema import parse_request

    tenant = 10**9 + 7
    client = redis_async()
    base = cache.prefix(tenant)
    await client.eval(cache.PURGE.source, 1, base)
    key = KeyInfo(
        1, "p", "d", tenant, "t", 1, frozenset(), None, (), (), ("semantic", 3600, 0.95, "e")
    )

    def ticket() -> cache.Ticket:
        parsed = parse_request(_json(_body("a question", 32, stream=False)), "chat.completions")
        found = cache.ticket(key, parsed, version="v", max_tokens=32, asked=None, mode="online")
        assert found is not None and found.semantic is not None
        return found

    partition = ticket().semantic.partition  # type: ignore[union-attr]
    draw = np.random.default_rng(7)
    vectors = draw.standard_normal((entries, dims)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    answer = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"x"}}]}'
    pipe = client.pipeline(transaction=False)
    for i in range(entries):
        pipe.eval(
            cache.STORE.source, 1, base, f"d{i}", answer, 3_600_000, entries + 1, 2**40,
            partition, vectors[i].tobytes(),
        )  # fmt: skip
        if i % 1000 == 999:
            await pipe.execute()
    await pipe.execute()
    timings: dict[str, list[float]] = {"cold": [], "warm": [], "hits": []}
    for i in range(lookups):
        query = (
            vectors[i % entries]
            if i % 2
            else cache_semantic.unit_vector(draw.standard_normal(dims))
        )
        found = ticket()
        started = time.perf_counter()
        await cache_semantic.lookup_similar(found, np.asarray(query, dtype=np.float32))
        took = (time.perf_counter() - started) * 1000
        timings["cold" if i == 0 else "warm"].append(took)
        if found.hit:
            timings["hits"].append(took)
    # Changing under the lookups: a new answer stored (the least recently used evicted) before
    # each; the copy takes the changes since its last read.
    churn: list[float] = []
    for i in range(lookups // 2):
        vector = cache_semantic.unit_vector(draw.standard_normal(dims))
        await client.eval(
            cache.STORE.source, 1, base, f"n{i}", answer, 3_600_000, entries, 2**40,
            partition, np.asarray(vector, dtype=np.float32).tobytes(),
        )  # fmt: skip
        found = ticket()
        started = time.perf_counter()
        await cache_semantic.lookup_similar(found, np.asarray(vector, dtype=np.float32))
        churn.append((time.perf_counter() - started) * 1000)
    await client.eval(cache.PURGE.source, 1, base)
    warm = timings["warm"]
    return {
        "entries": entries,
        "dims": dims,
        "first_lookup_ms": timings["cold"][0],
        "p50_ms": percentile(warm, 50),
        "p99_ms": percentile(warm, 99),
        "hit_p99_ms": percentile(timings["hits"], 99),
        "hits": len(timings["hits"]),
        "changing_p50_ms": percentile(churn, 50),
        "changing_p99_ms": percentile(churn, 99),
    }


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests in the workload")
    parser.add_argument("--samples", type=int, default=100, help="TTFT samples per kind")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--workers", type=int, default=2, help="gateway web processes")
    parser.add_argument("--entries", type=int, default=10_000, help="semantic: stored answers")
    parser.add_argument("--dims", type=int, default=384, help="semantic: vector size")
    parser.add_argument("--semantic-only", action="store_true", help="only part 4 (no engine)")
    args = parser.parse_args()
    django_setup()
    if args.semantic_only:
        print(asyncio.run(semantic_lookup(args.entries, args.dims, 2000)))
        return
    from tenants.models import Tenant
    from tenants.services import tenant_cache_update

    bench = Bench()
    try:
        engine = bench.start_engine()
        seed([engine], max_inflight=8)
        keys = {"off": tenant_key("bench-cache-off"), "on": tenant_key("bench-cache-on")}
        tenant_cache_update(
            tenant=Tenant.objects.get(slug="bench-cache-on"), actor=None, mode="exact"
        )
        gateway = bench.start_gateway(workers=args.workers)
        results = asyncio.run(run(args, engine, gateway, keys))
    finally:
        bench.stop()
    results["semantic"] = asyncio.run(semantic_lookup(args.entries, args.dims, 2000))
    results["config"] = vars(args)
    out = ROOT / "var" / "bench-results" / "cache.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    tokens = results["engine_tokens"]
    print(
        f"engine tokens, {args.requests} requests ({results['repeats']} repeats): without the "
        f"cache {tokens['off']:.0f}, with it {tokens['on']:.0f}: "
        f"{(1 - results['tokens_ratio']) * 100:.1f}% fewer (goal >= 25%)"
    )
    print(f"  outcomes with the cache: {results['outcomes_with_cache']}")
    hit = results["hit_ttft_ms"]
    print(
        f"hit TTFT p50 {hit['p50']:.2f} ms, p90 {hit['p90']:.2f}, p99 {hit['p99']:.2f} "
        "(goal p50 <= 5 ms)"
    )
    for name, qs in results["miss_ttft_ms"].items():
        print(f"  miss TTFT, cache {name:<3} p50 {qs['p50']:6.2f} ms  p90 {qs['p90']:6.2f} ms")
    print(f"a miss adds {results['miss_added_p50_ms']:.2f} ms at p50 (goal <= 1)")
    sem = results["semantic"]
    print(
        f"semantic lookup, {sem['entries']} entries of {sem['dims']} dims: p50 "
        f"{sem['p50_ms']:.3f} ms, p99 {sem['p99_ms']:.3f} ms (goal p99 <= 2), hits' p99 "
        f"{sem['hit_p99_ms']:.3f} ms ({sem['hits']} hits); the first, fetching the partition: "
        f"{sem['first_lookup_ms']:.1f} ms; with a store before each: p50 "
        f"{sem['changing_p50_ms']:.3f} ms, p99 {sem['changing_p99_ms']:.3f} ms"
    )
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
