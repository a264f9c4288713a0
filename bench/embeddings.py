"""Embeddings through the gateway against the same requests straight to the engine.

One embedding engine (the tiny model, ``--runner pooling --convert embed``, as the Procfile's
``engine-embed``) and a gateway in front of it (two web processes, as ``make run``). First one
request at a time, alternating gateway and engine (latency: what the gateway adds, p50 and
p90); then, for each number of clients C, C clients each sending requests back to back for a
fixed time, to the engine alone, then to the gateway alone. Each request embeds one short
sentence. A target's throughput is the most requests/s it answered at any C: its capacity.
At a few clients a closed loop measures latency again (each client waits for its answer
before it sends the next), so the ratio at each C is printed too.

Goal: the gateway's throughput >= 0.9x the engine's, and <= 2 ms added at p50.

    .venv/bin/python -m bench.embeddings [--samples 200] [--clients 8,32] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

from bench.harness import ROOT, Bench, django_setup, percentile, tenant_key
from devkit.engines import EMBED_ENGINE_ARGS

TEXT = "the pool serves many tenants"


def _seed(engine: str) -> None:
    from fleet.models import Model, Pool, Replica
    from inference.catalog import catalog_publish
    from inference.services import model_ensure, pool_ensure, replica_probe

    # The bench's engine serves the tiny model under its own name (tiny-chat), converted.
    model = model_ensure(
        name="tiny-embed", served_name="tiny-chat", context_length=1024, task=Model.Task.EMBED
    )
    pool = pool_ensure(name="embed", kind="dedicated", model=model, replica_urls=[engine])
    Pool.objects.filter(pk=pool.pk).update(max_inflight=64, max_queue_wait_seconds=600)
    for replica in Replica.objects.filter(pool=pool):
        replica_probe(replica=replica)
    catalog_publish()


Target = tuple[str, dict[str, str], dict[str, Any]]  # url, headers, body


async def _one(session: aiohttp.ClientSession, target: Target) -> float:
    url, headers, body = target
    started = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as response:
        await response.read()
        response.raise_for_status()
    return (time.perf_counter() - started) * 1000


async def _throughput(
    session: aiohttp.ClientSession, target: Target, clients: int, seconds: float
) -> tuple[float, int]:
    done = 0
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await _one(session, target)
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (time.perf_counter() - started), done


async def run(
    args: argparse.Namespace, bench: Bench, engine: str, gateway: str, key: str
) -> dict[str, Any]:
    body = {"input": TEXT, "encoding_format": "float"}
    targets: dict[str, Target] = {
        "direct": (f"{engine}/v1/embeddings", {}, {**body, "model": "tiny-chat"}),
        "gateway": (
            f"{gateway}/v1/embeddings",
            {"authorization": f"Bearer {key}"},
            {**body, "model": "tiny-embed"},
        ),
    }
    latency: dict[str, list[float]] = {name: [] for name in targets}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        for target in targets.values():  # warm both paths
            for _ in range(5):
                await _one(session, target)
        for i in range(args.samples):
            for name in list(targets) if i % 2 == 0 else reversed(list(targets)):
                latency[name].append(await _one(session, targets[name]))
        by_clients: dict[int, dict[str, float]] = {}
        cpu_per_request: dict[int, float] = {}
        for clients in args.clients:
            by_clients[clients] = {}
            for name, target in targets.items():
                cpu = bench.web_cpu_seconds()
                rate, done = await _throughput(session, target, clients, args.seconds)
                by_clients[clients][name] = rate
                if name == "gateway":
                    cpu_per_request[clients] = (bench.web_cpu_seconds() - cpu) / max(1, done) * 1e6
    rates = {name: max(r[name] for r in by_clients.values()) for name in targets}
    return {
        "latency_ms": {
            name: {f"p{q}": percentile(values, q) for q in (50, 90)}
            for name, values in latency.items()
        },
        "requests_per_second": rates,
        "requests_per_second_by_clients": by_clients,
        "added_p50_ms": percentile(latency["gateway"], 50) - percentile(latency["direct"], 50),
        "throughput_ratio": rates["gateway"] / rates["direct"],
        "web_cpu_us_per_request_by_clients": cpu_per_request,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--samples", type=int, default=200, help="requests per target, one at a time"
    )
    parser.add_argument(
        "--clients",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[8, 32],
        help="concurrent clients for throughput, a comma-separated list (each target's best "
        "is its throughput)",
    )
    parser.add_argument("--seconds", type=float, default=15, help="per throughput run")
    parser.add_argument("--workers", type=int, default=2, help="gateway web processes")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the engine alone on CPU 0, the gateway and the clients on CPU 1 (as in "
        "production, where the gateway never takes the engine's processor)",
    )
    args = parser.parse_args()
    django_setup()
    bench = Bench(pin=args.pin)
    try:
        engine = bench.start_engine(*EMBED_ENGINE_ARGS)
        _seed(engine)
        key = tenant_key("bench-embeddings")
        gateway = bench.start_gateway(workers=args.workers)
        results = asyncio.run(run(args, bench, engine, gateway, key))
    finally:
        bench.stop()
    results["config"] = vars(args)
    out = ROOT / "var" / "bench-results" / f"embeddings{'-pinned' if args.pin else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    for name, qs in results["latency_ms"].items():
        print(f"  {name:<8} p50 {qs['p50']:6.2f} ms  p90 {qs['p90']:6.2f} ms")
    for clients, rates in results["requests_per_second_by_clients"].items():
        print(
            f"  {clients:>3} clients: direct {rates['direct']:7.1f}  gateway "
            f"{rates['gateway']:7.1f} requests/s  ({rates['gateway'] / rates['direct']:.2f}x); "
            f"web CPU {results['web_cpu_us_per_request_by_clients'][clients]:.0f} µs a request"
        )
    for name, rate in results["requests_per_second"].items():
        print(f"  {name:<8} {rate:7.1f} requests/s at best")
    print(
        f"added at p50: {results['added_p50_ms']:.2f} ms (goal <= 2); gateway/engine "
        f"throughput {results['throughput_ratio']:.2f} (goal >= 0.9)"
    )
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
