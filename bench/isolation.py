"""Noisy neighbours: how long a short request takes while other tenants' long streams run.

K long streams (another tenant's, through the gateway, restarted as each ends) keep the
engine busy; meanwhile short requests (a 1-token chat completion, and the health check) are
sent one at a time, alternating between the gateway and the engine directly, so both see
the same load in the same run. Before any of that, the same short requests on an idle
engine give the floor.

Reports p50/p90/p99 of each and the gateway/direct ratio. Goal: p99 ratio <= 1.5. The
stack is started as ``make run`` starts it (the engine through ``sh -c`` like the Procfile
runner, the web server with two workers).

    .venv/bin/python -m bench.isolation [--long 2] [--long-tokens 900] [--samples 150]
        [--engine-nice 0]   # the engine at full weight, as before scripts/engine.sh lowered it
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from typing import Any

import aiohttp

from bench.harness import ROOT, Bench, django_setup, percentile, seed, stream_body, tenant_key

QUANTILES = (50, 90, 99)


async def _long_stream_forever(
    session: aiohttp.ClientSession, url: str, key: str, tokens: int, counter: list[int]
) -> None:
    body = stream_body(max_tokens=tokens)
    headers = {"authorization": f"Bearer {key}"}
    while True:
        async with session.post(url, json=body, headers=headers) as response:
            response.raise_for_status()
            async for _ in response.content.iter_any():
                pass
        counter[0] += 1


async def _timed(session: aiohttp.ClientSession, method: str, url: str, **kwargs: Any) -> float:
    started = time.perf_counter()
    async with session.request(method, url, **kwargs) as response:
        await response.read()
        response.raise_for_status()
    return (time.perf_counter() - started) * 1000


async def _sample(
    session: aiohttp.ClientSession, targets: dict[str, dict[str, Any]], samples: int
) -> dict[str, list[float]]:
    """Latencies (ms) of each target's request, sent one at a time, alternating order."""
    out: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)
    for i in range(samples):
        for name in names if i % 2 == 0 else reversed(names):
            out[name].append(await _timed(session, **targets[name]))
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in QUANTILES}


async def run(args: argparse.Namespace, engine: str, gateway: str, key: str, noisy: str) -> Any:
    short = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "temperature": 0,
    }
    targets: dict[str, dict[str, Any]] = {
        "chat_direct": {"method": "POST", "url": f"{engine}/v1/chat/completions", "json": short},
        "chat_gateway": {
            "method": "POST",
            "url": f"{gateway}/v1/chat/completions",
            "json": short,
            "headers": {"authorization": f"Bearer {key}"},
        },
        "health_direct": {"method": "GET", "url": f"{engine}/health"},
        "health_gateway": {"method": "GET", "url": f"{gateway}/healthz"},
    }
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    results: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=connector) as session:
        await _sample(session, targets, 10)  # warm connections and caches
        idle = await _sample(session, targets, args.idle_samples)
        results["idle_ms"] = {name: _summary(v) for name, v in idle.items()}
        finished = [0]
        neighbours = [
            asyncio.create_task(
                _long_stream_forever(
                    session, f"{gateway}/v1/chat/completions", noisy, args.long_tokens, finished
                )
            )
            for _ in range(args.long)
        ]
        await asyncio.sleep(2)  # the long streams are past their prefill
        started = time.perf_counter()
        try:
            loaded = await _sample(session, targets, args.samples)
        finally:
            for task in neighbours:
                task.cancel()
            for task in neighbours:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        results["loaded_seconds"] = time.perf_counter() - started
        results["long_streams_finished"] = finished[0]
        results["loaded_ms"] = {name: _summary(v) for name, v in loaded.items()}
        results["ratio"] = {
            kind: {
                f"p{q}": results["loaded_ms"][f"{kind}_gateway"][f"p{q}"]
                / results["loaded_ms"][f"{kind}_direct"][f"p{q}"]
                for q in QUANTILES
            }
            for kind in ("chat", "health")
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", type=int, default=2, help="long streams running meanwhile")
    parser.add_argument("--long-tokens", type=int, default=900, help="tokens per long stream")
    parser.add_argument("--samples", type=int, default=150, help="short requests per target")
    parser.add_argument("--idle-samples", type=int, default=40, help="the same, idle engine")
    parser.add_argument("--workers", type=int, default=2, help="gateway web processes")
    parser.add_argument(
        "--engine-nice",
        type=int,
        default=None,
        help="the engine's scheduling niceness (scripts/engine.sh: 10); 0 shows the stalls",
    )
    args = parser.parse_args()
    if args.engine_nice is not None:
        os.environ["ENGINE_NICE"] = str(args.engine_nice)
    django_setup()
    bench = Bench()
    try:
        engine = bench.start_engine()
        seed([engine], max_inflight=64)
        key = tenant_key("bench-isolation-short")
        noisy = tenant_key("bench-isolation-long")
        gateway = bench.start_gateway(workers=args.workers)
        results = asyncio.run(run(args, engine, gateway, key, noisy))
    finally:
        bench.stop()
    results["config"] = vars(args)
    suffix = "" if args.engine_nice is None else f"-nice{args.engine_nice}"
    out = ROOT / "var" / "bench-results" / f"isolation{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    for phase in ("idle_ms", "loaded_ms"):
        print(f"{phase.removesuffix('_ms')}:")
        for name, qs in results[phase].items():
            cells = "  ".join(f"p{q} {qs[f'p{q}']:7.1f}" for q in QUANTILES)
            print(f"  {name:<15} {cells}  ms")
    for kind, qs in results["ratio"].items():
        cells = "  ".join(f"p{q} {qs[f'p{q}']:.2f}" for q in QUANTILES)
        print(f"gateway/direct {kind:<7} {cells}   (goal: p99 <= 1.5)")
    print(
        f"{args.long} long streams of {args.long_tokens} tokens, {results['long_streams_finished']}"
        f" finished during {results['loaded_seconds']:.1f} s of sampling"
    )
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
