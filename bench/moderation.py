"""Moderation's cost: the same gateway, engine and load for a tenant without moderation and
one with it (rules + the embedded classifier, async mode, the default window), interleaved
in one run.

Reports added TTFT (p50, p99; goal <= 2 ms p50), inter-token latency p95 (goal <= +5%), the
64-stream wall-time ratio (goal <= 1.05); with a guard model slower than the prefill (long
new prompts), TTFT against the guard's own latency and against the sum of both (goal: about
the guard's, never the sum); and the cut distance of a deny term the model really writes:
tokens delivered after it began (async: <= one window; hold: none).

    .venv/bin/python -m bench.moderation [--pairs 60] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from typing import Any

import aiohttp
from asgiref.sync import sync_to_async

from bench.harness import ROOT, Bench, django_setup, percentile, seed, stream_body, tenant_key

TERMS = [f"forbidden-{i}" for i in range(200)]  # a realistic deny list that never fires
CUT: list[str] = []  # streams the cost runs saw cut (none may be: it would skew the ratios)


async def one_stream(
    session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]
) -> tuple[float, list[float], float, list[dict[str, Any]]]:
    """(TTFT, gaps between content chunks, total time, the chunks) of one streamed request."""
    started = time.perf_counter()
    ttft, last, gaps, chunks = 0.0, 0.0, [], []
    async with session.post(url, json=body, headers={"authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            if not chunk.get("choices"):
                continue
            if chunk["choices"][0].get("finish_reason") == "content_filter":
                CUT.append(url)
            if not ttft:
                ttft = now - started
            elif last:
                gaps.append(now - last)
            last = now
    return ttft, gaps, time.perf_counter() - started, chunks


def policy(slug: str, **changes: Any) -> None:
    from moderation.services import moderation_policy_set
    from tenants.models import Tenant

    moderation_policy_set(tenant=Tenant.objects.get(slug=slug), changes=changes, actor=None)


def deltas(chunks: list[dict[str, Any]]) -> list[tuple[str, int]]:
    out = []
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                out.append((content, len((choice.get("logprobs") or {}).get("content") or ())))
    return out


async def cost(args: argparse.Namespace, session: Any, url: str, keys: dict[str, str]) -> Any:
    results: dict[str, Any] = {}
    short = stream_body(max_tokens=16)
    for _ in range(5):
        for key in keys.values():
            await one_stream(session, url, key, short)
    ttft: dict[str, list[float]] = {name: [] for name in keys}
    for i in range(args.pairs):
        for name in list(keys) if i % 2 == 0 else list(reversed(keys)):
            ttft[name].append((await one_stream(session, url, keys[name], short))[0] * 1000)
    results["ttft_ms"] = {
        n: {"p50": percentile(v, 50), "p99": percentile(v, 99)} for n, v in ttft.items()
    }
    results["ttft_added_ms"] = {
        q: results["ttft_ms"]["on"][q] - results["ttft_ms"]["off"][q] for q in ("p50", "p99")
    }
    long = stream_body(max_tokens=args.tokens)
    gaps: dict[str, list[float]] = {name: [] for name in keys}
    for i in range(args.itl_runs):
        for name in list(keys) if i % 2 == 0 else list(reversed(keys)):
            gaps[name] += (await one_stream(session, url, keys[name], long))[1]
    results["itl_p50_ms"] = {n: percentile(v, 50) * 1000 for n, v in gaps.items()}
    results["itl_p95_ms"] = {n: percentile(v, 95) * 1000 for n, v in gaps.items()}
    results["itl_p95_ratio"] = results["itl_p95_ms"]["on"] / results["itl_p95_ms"]["off"]
    walls: dict[str, list[float]] = {name: [] for name in keys}
    for rep in range(args.reps):
        for name in list(keys) if rep % 2 == 0 else list(reversed(keys)):
            started = time.perf_counter()
            await asyncio.gather(*(one_stream(session, url, keys[name], long) for _ in range(64)))
            walls[name].append(time.perf_counter() - started)
    results["wall_64"] = {
        "off_s": statistics.median(walls["off"]),
        "on_s": statistics.median(walls["on"]),
        "ratio": statistics.median(walls["on"]) / statistics.median(walls["off"]),
        "runs": walls,
    }
    return results


async def slow_guard(session: Any, url: str, keys: dict[str, str]) -> Any:
    """TTFT with a guard model slower than the prefill: long prompts, each new (the engine
    caches prefixes), checked by the guard in pieces while the engine does its prefill. The
    guard's own latency is asked of the same gateway (``/v1/moderations``, the guard named)
    for the same text. Done right, TTFT is about the guard's latency (the slower of the
    two), not the guard's plus the prefill's."""
    moderations = url.replace("/chat/completions", "/moderations")
    samples: dict[str, list[float]] = {"off": [], "guarded": [], "guard_alone": []}
    for i in range(16):
        words = " ".join(f"w{i}x{j}" for j in range(120))  # ~800 characters, new each time
        text = f"Request {i}: summarise these notes: {words}"
        body = stream_body(max_tokens=2, messages=[{"role": "user", "content": text}])
        started = time.perf_counter()
        headers = {"authorization": f"Bearer {keys['guarded']}"}
        async with session.post(
            moderations, json={"model": "tiny-guard", "input": text}, headers=headers
        ) as r:
            await r.read()
        samples["guard_alone"].append((time.perf_counter() - started) * 1000)
        for name in ("off", "guarded") if i % 2 == 0 else ("guarded", "off"):
            unique = body | {"messages": [{"role": "user", "content": f"{name} {text}"}]}
            samples[name].append((await one_stream(session, url, keys[name], unique))[0] * 1000)
    p50 = {name: statistics.median(v) for name, v in samples.items()}
    return {
        "ttft_p50_ms": p50,
        "sum_ms": p50["off"] + p50["guard_alone"],
        "guarded_over_max": p50["guarded"] / max(p50["off"], p50["guard_alone"]),
        "guarded_over_sum": p50["guarded"] / (p50["off"] + p50["guard_alone"]),
    }


async def cut_distance(session: Any, url: str, keys: dict[str, str], slug: str) -> Any:
    body = stream_body(max_tokens=120, logprobs=True)
    body.pop("stream_options")
    greedy = deltas((await one_stream(session, url, keys["off"], body))[3])
    text = "".join(t for t, _ in greedy)
    words = [m for m in re.finditer(r"(?<![\w])[A-Za-z]{3,12}(?![\w])", text)]
    out: dict[str, Any] = {}
    for match in words:
        chars = tokens = 0
        for delta, count in greedy:
            if chars + len(delta) > match.start():
                break
            chars, tokens = chars + len(delta), tokens + count
        if tokens < 40:
            continue
        term, at = match.group(), tokens
        if re.search(rf"(?<![\w]){re.escape(term)}(?![\w])", text[: match.start()], re.I):
            continue  # its first appearance only
        for mode in ("async", "hold"):
            await sync_to_async(policy)(slug, deny_terms=[term], output_mode=mode, classifier=True)
            await asyncio.sleep(2.2)
            got = deltas((await one_stream(session, url, keys["on"], body))[3])
            delivered = sum(count for _, count in got)
            shown = "".join(t for t, _ in got).lower()
            out[mode] = {
                "term": term,
                "starts_at_token": at,
                "delivered_tokens": delivered,
                "after_it_began": delivered - at,
                "reached_client": term.lower() in shown,
            }
        break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=60, help="TTFT samples per tenant")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the 64-stream run")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--itl-runs", type=int, default=20, help="streams per tenant for ITL")
    args = parser.parse_args()
    django_setup()
    bench = Bench()
    try:
        # Each engine on a core of its own (as on machines of their own): on two shared
        # cores, two busy engines' threads fight, and that — not moderation — would be
        # what the slow-guard run measured.
        engine = bench.start_engine(core=0)
        guard = bench.start_guard_engine(core=1)
        seed([engine], max_inflight=64)
        from fleet.models import Model, Replica
        from inference.catalog import catalog_publish
        from inference.services import model_ensure, pool_ensure, replica_probe

        model = model_ensure(name="tiny-guard", served_name="tiny-guard", context_length=1024,
                             task=Model.Task.CLASSIFY)  # fmt: skip
        pool_ensure(name="guard", kind="dedicated", model=model, replica_urls=[guard])
        for replica in Replica.objects.filter(pool__name="guard"):
            replica_probe(replica=replica)
        catalog_publish()
        keys = {"off": tenant_key("bench-mod-off"), "on": tenant_key("bench-mod-on")}
        guarded_key = tenant_key("bench-mod-guard")
        policy("bench-mod-on", deny_terms=TERMS, regexes=[r"\bsecret-\d{6}\b"], pii_action="log",
               classifier=True, output_mode="async")  # fmt: skip
        policy("bench-mod-guard", classifier=False, guard_model="tiny-guard", budget_ms=2000,
               check_output=False)  # fmt: skip
        gateway = bench.start_gateway()

        async def everything() -> dict[str, Any]:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
            async with aiohttp.ClientSession(connector=connector) as session:
                url = f"{gateway}/v1/chat/completions"
                out: dict[str, Any] = await cost(args, session, url, keys)
                out["streams_cut_in_cost_runs"] = len(CUT)
                assert not CUT, "a cost run's stream was cut: the comparison is not like for like"
                out["slow_guard"] = await slow_guard(
                    session, url, {"off": keys["off"], "guarded": guarded_key}
                )
                out["cut"] = await cut_distance(session, url, keys, "bench-mod-on")
                return out

        results: dict[str, Any] = asyncio.run(everything())
    finally:
        bench.stop()
    results["config"] = vars(args)
    out = ROOT / "var" / "bench-results" / "moderation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    t, a = results["ttft_ms"], results["ttft_added_ms"]
    print(
        f"TTFT (ms): off p50 {t['off']['p50']:.1f} p99 {t['off']['p99']:.1f} | on p50 "
        f"{t['on']['p50']:.1f} p99 {t['on']['p99']:.1f} | added p50 {a['p50']:+.2f} p99 "
        f"{a['p99']:+.2f}"
    )
    i = results["itl_p95_ms"]
    m = results["itl_p50_ms"]
    print(
        f"ITL (ms): p50 off {m['off']:.2f} on {m['on']:.2f} | p95 off {i['off']:.2f}, on "
        f"{i['on']:.2f}, ratio {results['itl_p95_ratio']:.3f}"
    )
    w = results["wall_64"]
    print(f"64 streams: off {w['off_s']:.2f}s, on {w['on_s']:.2f}s, ratio {w['ratio']:.3f}")
    s = results["slow_guard"]
    p = s["ttft_p50_ms"]
    print(
        f"slow guard (long new prompts): the guard alone {p['guard_alone']:.1f} ms, TTFT off "
        f"{p['off']:.1f} ms, guarded "
        f"{p['guarded']:.1f} ms = {s['guarded_over_max']:.2f} x max, {s['guarded_over_sum']:.2f}"
        " x sum"
    )
    for mode, c in results["cut"].items():
        print(
            f"cut ({mode}): {c['term']!r} at token {c['starts_at_token']}, "
            f"{c['after_it_began']:+d} tokens delivered after it began, "
            f"reached the client: {c['reached_client']}"
        )


if __name__ == "__main__":
    main()
