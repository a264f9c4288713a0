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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests in the workload")
    parser.add_argument("--samples", type=int, default=100, help="TTFT samples per kind")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--workers", type=int, default=2, help="gateway web processes")
    args = parser.parse_args()
    django_setup()
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
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
