"""Embeddings through the gateway against the same requests straight to the engine.

One embedding engine (the tiny model, ``--runner pooling --convert embed``, as the Procfile's
``engine-embed``) and a gateway in front of it (two web processes, as ``make run``). First one
request at a time, alternating gateway and engine (latency: what the gateway adds, p50 and
p90); then, for each number of clients C, C clients each sending requests back to back for a
fixed time, to the engine alone, then to the gateway alone. Each request embeds one short
sentence. A target's throughput is the most requests/s it answered at any C: its capacity.
At a few clients a closed loop measures latency again (each client waits for its answer
before it sends the next), so the ratio at each C is printed too.

The throughput load comes from a lean client (``Connection``: one keep-alive connection per
client, the request's bytes prepared once, the answer read by its ``content-length``), not
aiohttp's (several times the CPU a request: bench/RESULTS.md): with
``--pin`` the load generator shares the gateway's core, and a heavy one takes that core from
the gateway alone (the engine's core is not touched by it). ``--client aiohttp`` keeps the old
one, to compare.

``--floor`` adds two targets where the gateway runs (its core, with ``--pin``), each a
pass-through with none of the gateway's work: ``relay`` (``bench.floor_relay``: the gateway's
server and HTTP client, uvicorn and aiohttp, the same number of processes) and ``proxy``
(``bench.floor_proxy``: bytes passed on, the least any proxy costs the engine's throughput on
this machine; ``--floor-burn-us N``: one spending N µs of CPU on each request).

Goal: the gateway's throughput >= 0.9x the engine's, and <= 2 ms added at p50.

    .venv/bin/python -m bench.embeddings [--samples 200] [--clients 32,128] [--seconds 15]
        [--pin] [--floor [--floor-burn-us N]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import uvloop

from bench.floor_proxy import read_message
from bench.harness import ROOT, Bench, django_setup, percentile, tenant_key
from bench.peers import start_floor
from devkit.engines import EMBED_ENGINE_ARGS

TEXT = "the pool serves many tenants"
WARM_SECONDS = 3


def _seed(engine: str) -> None:
    from fleet.models import Model, Pool, Replica
    from inference.catalog import catalog_publish
    from inference.services import model_ensure, pool_ensure, replica_probe

    # The bench's engine serves the tiny model under its own name (tiny-chat), converted.
    model = model_ensure(
        name="tiny-embed", served_name="tiny-chat", context_length=1024, task=Model.Task.EMBED
    )
    pool = pool_ensure(name="embed", kind="dedicated", model=model, replica_urls=[engine])
    Pool.objects.filter(pk=pool.pk).update(max_inflight=256, max_queue_wait_seconds=600)
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


class Connection:
    """One keep-alive HTTP/1.1 connection sending one prepared request over and over: a few
    tens of µs of the load generator's CPU a request."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Connection:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer)

    @staticmethod
    def prepare(target: Target) -> bytes:
        url, headers, body = target
        parts = urlsplit(url)
        payload = json.dumps(body).encode()
        lines = [f"POST {parts.path} HTTP/1.1", f"host: {parts.netloc}"]
        lines += ["content-type: application/json", f"content-length: {len(payload)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload

    async def send(self, request: bytes) -> None:
        self.writer.write(request)
        head, _, length = await read_message(self.reader)
        if length is None:  # both the gateway and the engine declare their answers' size
            raise RuntimeError("an answer without content-length")
        status = int(head[9:12])
        if status != 200:
            raise RuntimeError(f"HTTP {status}")

    def close(self) -> None:
        self.writer.close()


async def _throughput(
    session: aiohttp.ClientSession, target: Target, clients: int, seconds: float, lean: bool
) -> tuple[float, int]:
    done = 0
    deadline = time.perf_counter() + seconds
    request = Connection.prepare(target)

    async def client() -> None:
        nonlocal done
        if not lean:
            while time.perf_counter() < deadline:
                await _one(session, target)
                done += 1
            return
        connection = await Connection.open(target[0])
        try:
            while time.perf_counter() < deadline:
                await connection.send(request)
                done += 1
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (time.perf_counter() - started), done


async def run(
    args: argparse.Namespace,
    bench: Bench,
    engine: str,
    gateway: str,
    key: str,
    floors: dict[str, str],
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
    for name, url in floors.items():  # pass-through proxies where the gateway runs
        targets[name] = (f"{url}/v1/embeddings", {}, {**body, "model": "tiny-chat"})
    latency: dict[str, list[float]] = {name: [] for name in targets}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        # Warm both paths for a few seconds: a web process's first seconds are its start (the
        # moderation classifier loading beside it, the collections that freeze what it keeps:
        # controlplane.collector), not what it adds to a request.
        warm_until = time.perf_counter() + WARM_SECONDS
        while time.perf_counter() < warm_until:
            for target in targets.values():
                await _one(session, target)
        for i in range(args.samples):
            for name in list(targets) if i % 2 == 0 else reversed(list(targets)):
                latency[name].append(await _one(session, targets[name]))
        by_clients: dict[int, dict[str, float]] = {}
        cpu_per_request: dict[int, float] = {}
        floor_cpu: dict[int, dict[str, float]] = {}
        # the processes each proxy target runs in (its CPU a request is printed)
        process = {"gateway": "web", "relay": "floor-relay", "proxy": "floor-proxy"}
        load_cpu: dict[int, dict[str, float]] = {}
        for clients in args.clients:
            by_clients[clients] = {}
            for name, target in targets.items():
                cpu, own = bench.web_cpu_seconds(process.get(name, "web")), os.times()
                rate, done = await _throughput(
                    session, target, clients, args.seconds, lean=args.client == "lean"
                )
                by_clients[clients][name] = rate
                spent = sum(os.times()[:2]) - sum(own[:2])
                load_cpu.setdefault(clients, {})[name] = spent / max(1, done) * 1e6
                used = (bench.web_cpu_seconds(process.get(name, "web")) - cpu) / max(1, done)
                if name == "gateway":
                    cpu_per_request[clients] = used * 1e6
                elif name in floors:
                    floor_cpu.setdefault(clients, {})[name] = used * 1e6
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
        "floor_ratios": {name: rates[name] / rates["direct"] for name in floors},
        "floor_cpu_us_per_request_by_clients": floor_cpu,
        "web_cpu_us_per_request_by_clients": cpu_per_request,
        "load_generator_cpu_us_per_request_by_clients": load_cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--samples", type=int, default=200, help="requests per target, one at a time"
    )
    parser.add_argument(
        "--clients",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[32, 128],
        help="concurrent clients for throughput, a comma-separated list (each target's best "
        "is its throughput)",
    )
    parser.add_argument("--seconds", type=float, default=15, help="per throughput run")
    parser.add_argument(
        "--client",
        choices=("lean", "aiohttp"),
        default="lean",
        help="the throughput load's HTTP client (lean: a few tens of µs a request)",
    )
    parser.add_argument("--workers", type=int, default=2, help="gateway web processes")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="two more targets where the gateway runs: relay (bench.floor_relay: the "
        "gateway's server and HTTP client, nothing else) and proxy (bench.floor_proxy: "
        "bytes passed on, the least any proxy costs the engine's throughput here)",
    )
    parser.add_argument(
        "--floor-burn-us",
        type=float,
        default=0,
        help="with --floor: CPU the proxy target spends on each request (a proxy doing that much)",
    )
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
        floors = {}
        if args.floor:
            relay, floors["relay"] = start_floor(
                engine, workers=args.workers, cpus=bench.gateway_cpus
            )
            bench.processes["floor-relay"] = relay
            floors["proxy"] = bench.start_floor_proxy(engine, burn_us=args.floor_burn_us)
        # uvloop, as the gateway runs: the load generator's loop costs less of the core too
        results = uvloop.run(run(args, bench, engine, gateway, key, floors))
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
            + "".join(
                f"{name} {rates[name]:7.1f} ({rates[name] / rates['direct']:.2f}x, "
                f"{results['floor_cpu_us_per_request_by_clients'][clients][name]:.0f} µs a "
                "request); "
                for name in results["floor_ratios"]
            )
            + f"web CPU {results['web_cpu_us_per_request_by_clients'][clients]:.0f} µs a request; "
            "the load generator's "
            + ", ".join(
                f"{v:.0f} µs ({name})"
                for name, v in results["load_generator_cpu_us_per_request_by_clients"][
                    clients
                ].items()
            )
        )
    for name, rate in results["requests_per_second"].items():
        print(f"  {name:<8} {rate:7.1f} requests/s at best")
    print(
        f"added at p50: {results['added_p50_ms']:.2f} ms (goal <= 2); gateway/engine "
        f"throughput {results['throughput_ratio']:.2f} (goal >= 0.9)"
        + "".join(f"; {name} {ratio:.2f}" for name, ratio in results["floor_ratios"].items())
    )
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
