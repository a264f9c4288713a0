"""Token-fair admission under overload (the VTC paper's scenarios, scaled to the CPU engine).

Two tenants share a pool of capacity 4. Tenant A keeps 24 streams outstanding, tenant B
keeps 4. Weighted service = prompt + 2 x completion tokens (divided by the tenant's weight
for the difference). For each of vtc and fcfs, with one and two web processes, and with
equal and 1:2 weights, this reports each tenant's share of service, the accumulated service
difference over time against VTC's bound 2*max(w_in*L_in, w_out*M), and TTFT per tenant.
Goal: equal weights -> 50% +- 5% each; 1:2 -> 67% +- 5%; the difference stays within the
bound under vtc while under fcfs it grows without bound.

    .venv/bin/python -m bench.fairness [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import redis

from bench.harness import (
    REDIS_URL,
    ROOT,
    Bench,
    django_setup,
    percentile,
    seed,
    stream_body,
    tenant_key,
)

CAPACITY = 4
MAX_TOKENS = 64
OUTSTANDING = {"A": 24, "B": 4}


@dataclass
class Done:
    tenant: str
    started: float
    first: float
    finished: float
    prompt: int
    completion: int


async def client_loop(
    client: httpx.AsyncClient, url: str, key: str, tenant: str, until: float, log: list[Done]
) -> None:
    body = stream_body(max_tokens=MAX_TOKENS, stream_options={"include_usage": True})
    headers = {"authorization": f"Bearer {key}"}
    while time.monotonic() < until:
        started = time.monotonic()
        first = 0.0
        usage: dict[str, int] = {}
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                await asyncio.sleep(0.1)
                continue
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if not first:
                    first = time.monotonic()
                chunk = orjson.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
        log.append(
            Done(
                tenant,
                started,
                first,
                time.monotonic(),
                usage.get("prompt_tokens", 0),
                usage.get("completion_tokens", 0),
            )
        )


def analyse(log: list[Done], t0: float, seconds: float, weights: dict[str, int]) -> dict[str, Any]:
    warm = 3.0  # let the queues fill before counting
    window = [d for d in log if t0 + warm <= d.finished <= t0 + seconds]
    service = {
        t: sum(d.prompt + 2 * d.completion for d in window if d.tenant == t) for t in weights
    }
    total = sum(service.values()) or 1
    longest_prompt = max((d.prompt for d in log), default=0)
    m = CAPACITY * (longest_prompt + MAX_TOKENS)  # tokens that can be in flight at once
    bound = 2 * max(1 * longest_prompt, 2 * m)
    series = []
    for second in range(int(warm) + 1, int(seconds) + 1, 1):
        cut = t0 + second
        acc = {
            t: sum(
                d.prompt + 2 * d.completion
                for d in log
                if d.tenant == t and t0 + warm <= d.finished <= cut
            )
            / weights[t]
            for t in weights
        }
        series.append([second, round(acc["A"] - acc["B"])])
    return {
        "share": {t: service[t] / total for t in weights},
        "requests": {t: sum(1 for d in window if d.tenant == t) for t in weights},
        "service_diff_series": series,
        "max_abs_diff": max(abs(v) for _, v in series) if series else 0,
        "final_diff": series[-1][1] if series else 0,
        "vtc_bound": bound,
        "ttft_ms": {
            t: {
                "p50": percentile(
                    [(d.first - d.started) * 1000 for d in window if d.tenant == t], 50
                ),
                "p90": percentile(
                    [(d.first - d.started) * 1000 for d in window if d.tenant == t], 90
                ),
            }
            for t in weights
        },
    }


async def scenario(
    url: str, keys: dict[str, str], seconds: float, weights: dict[str, int]
) -> dict[str, Any]:
    log: list[Done] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.monotonic()
        until = t0 + seconds
        await asyncio.gather(
            *(
                client_loop(client, url, keys[t], t, until, log)
                for t, n in OUTSTANDING.items()
                for _ in range(n)
            )
        )
    return analyse(log, t0, seconds, weights)


def reset_admission() -> None:
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter("ip:{p:online}:*"):
        if not key.endswith((b":replicas", b":policy")):
            client.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument(
        "--runs",
        nargs="*",
        default=[],
        help="subset as policy:workers:weightA:weightB, e.g. vtc:1:1:1 fcfs:2:1:1",
    )
    args = parser.parse_args()
    django_setup()
    from fleet.models import Pool
    from inference.catalog import catalog_publish

    runs = [
        ("vtc", 1, {"A": 1, "B": 1}),
        ("fcfs", 1, {"A": 1, "B": 1}),
        ("vtc", 2, {"A": 1, "B": 1}),
        ("fcfs", 2, {"A": 1, "B": 1}),
        ("vtc", 1, {"A": 1, "B": 2}),
        ("vtc", 2, {"A": 1, "B": 2}),
    ]
    if args.runs:
        runs = []
        for spec in args.runs:
            policy, workers, wa, wb = spec.split(":")
            runs.append((policy, int(workers), {"A": int(wa), "B": int(wb)}))
    bench = Bench()
    results = []
    try:
        engine = bench.start_engine()
        seed([engine], max_inflight=CAPACITY)
        workers_running = 0
        for policy, workers, weights in runs:
            Pool.objects.filter(name="online").update(policy=policy)
            keys = {t: tenant_key(f"bench-{t.lower()}", weight=w) for t, w in weights.items()}
            catalog_publish()
            if workers != workers_running:
                bench.start_gateway(workers=workers)
                workers_running = workers
            time.sleep(1.5)  # web processes pick up the catalog; old key caches expire
            reset_admission()
            result = asyncio.run(
                scenario(bench.gateway_url + "/v1/chat/completions", keys, args.seconds, weights)
            )
            result.update(policy=policy, workers=workers, weights=weights)
            results.append(result)
            share_b = result["share"]["B"]
            print(
                f"{policy:4} workers={workers} weights A:B={weights['A']}:{weights['B']}  "
                f"share A {result['share']['A']:.1%} B {share_b:.1%}  "
                f"max|diff| {result['max_abs_diff']} (bound {result['vtc_bound']}), "
                f"final diff {result['final_diff']}  "
                f"TTFT p50 A {result['ttft_ms']['A']['p50']:.0f}ms B "
                f"{result['ttft_ms']['B']['p50']:.0f}ms",
                flush=True,
            )
    finally:
        bench.stop()
    out = ROOT / "var" / "bench-results" / "fairness.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
