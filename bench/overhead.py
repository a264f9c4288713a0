"""Gateway overhead: the same streaming work sent straight to the engine and through the
gateway, interleaved in one run on one engine.

Reports added TTFT (p50, p99) for one stream at a time (and the web processes' CPU per
request over that whole phase, the work after each answer's last byte included, less their
idle CPU measured just before), the wall time of N concurrent
streams (16 and 64) through the gateway divided by the same work sent direct, and the web
processes' CPU per streamed token. With ``--litellm``, LiteLLM's proxy (as many workers, in
its own virtualenv: ``bench.peers``) streams the same concurrent work from the same engine in
the same runs, and its CPU per token is printed beside the gateway's.
With ``--floor``, a pass-through relay under the same server (``bench.floor_relay``) does the
same, the floor of the gateway's per-token cost on this machine.
Goals: <= 2 ms added TTFT p50; wall-time ratio <= 1.10; <= 40 us of web CPU per token.

    .venv/bin/python -m bench.overhead [--pairs 60] [--reps 3] [--workers 1] [--litellm]
        [--floor] [--coalesce-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import aiohttp

from bench.harness import ROOT, Bench, django_setup, percentile, seed, stream_body, tenant_key
from bench.peers import LITELLM_KEY, start_floor, start_litellm

IDLE_SECONDS = 10.0  # the web processes' idle CPU, measured before the one-stream pairs


async def one_stream(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]
) -> tuple[float, float, int]:
    """(TTFT, total time, completion tokens) of one streamed request."""
    started = time.perf_counter()
    ttft = 0.0
    tokens = 0
    async with session.post(url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                if not ttft:
                    ttft = time.perf_counter() - started
                if b'"usage":{' in line:  # the final usage chunk (LiteLLM's has a choice)
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return ttft, time.perf_counter() - started, tokens


async def run(
    args: argparse.Namespace,
    engine: str,
    gateway: str,
    key: str,
    bench: Bench,
    peer_urls: dict[str, str],
) -> dict[str, Any]:
    targets = {
        "direct": (f"{engine}/v1/chat/completions", {}),
        "gateway": (f"{gateway}/v1/chat/completions", {"authorization": f"Bearer {key}"}),
    }
    # The peers stream the concurrent runs only: their CPU per token beside the gateway's.
    peer_headers = {"litellm": {"authorization": f"Bearer {LITELLM_KEY}"}, "floor": {}}
    peers = {
        name: (f"{url}/v1/chat/completions", peer_headers[name]) for name, url in peer_urls.items()
    }
    measured = {"gateway": "web", "litellm": "litellm", "floor": "floor"}  # whose CPU is read
    results: dict[str, Any] = {}
    # aiohttp as the load generator too: its C parser leaves the CPU to what is measured.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        body = stream_body(max_tokens=16)
        for _ in range(5):  # warm every path (connections, caches)
            for url, headers in [*targets.values(), *peers.values()]:
                await one_stream(session, url, headers, body)
        ttft: dict[str, list[float]] = {"direct": [], "gateway": []}
        cpu = 0.0  # the web server's CPU seconds spent on the gateway's streams
        # What the web processes spend idle, per second, to take off the whole phase's CPU
        # (which holds the work after each answer's last byte: the window above misses it).
        await asyncio.sleep(2)  # the warm-up's last requests settled
        idle_from, idle_at = bench.web_cpu_seconds(), time.perf_counter()
        await asyncio.sleep(IDLE_SECONDS)
        idle = (bench.web_cpu_seconds() - idle_from) / (time.perf_counter() - idle_at)
        phase_from, phase_at = bench.web_cpu_seconds(), time.perf_counter()
        for i in range(args.pairs):
            order = list(targets) if i % 2 == 0 else list(reversed(targets))
            for name in order:
                url, headers = targets[name]
                before = bench.web_cpu_seconds() if name == "gateway" else 0.0
                ttft[name].append((await one_stream(session, url, headers, body))[0] * 1000)
                if name == "gateway":
                    cpu += bench.web_cpu_seconds() - before
        await asyncio.sleep(2)  # the last answer's end (its record, its slot) done
        phase = bench.web_cpu_seconds() - phase_from
        phase_seconds = time.perf_counter() - phase_at
        results["web_cpu_ms_per_request_one_stream"] = cpu * 1000 / args.pairs
        results["web_idle_cpu_ms_per_s"] = idle * 1000
        results["web_cpu_ms_per_request_one_stream_whole"] = phase * 1000 / args.pairs
        results["web_cpu_ms_per_request_one_stream_net"] = (
            (phase - idle * phase_seconds) * 1000 / args.pairs
        )
        results["ttft_ms"] = {
            name: {"p50": percentile(v, 50), "p99": percentile(v, 99)} for name, v in ttft.items()
        }
        results["ttft_added_ms"] = {
            q: results["ttft_ms"]["gateway"][q] - results["ttft_ms"]["direct"][q]
            for q in ("p50", "p99")
        }
        body = stream_body(max_tokens=args.tokens)
        for concurrency in (16, 64):
            runs = {**targets, **peers}
            walls: dict[str, list[float]] = {name: [] for name in runs}
            cpus = dict.fromkeys(runs, 0.0)
            for rep in range(args.reps):
                order = list(runs) if rep % 2 == 0 else list(reversed(runs))
                for name in order:
                    url, headers = runs[name]
                    process = measured.get(name)
                    before = bench.web_cpu_seconds(process) if process else 0.0
                    started = time.perf_counter()
                    done = await asyncio.gather(
                        *(one_stream(session, url, headers, body) for _ in range(concurrency))
                    )
                    walls[name].append(time.perf_counter() - started)
                    if process:
                        cpus[name] += bench.web_cpu_seconds(process) - before
                    assert all(tokens == args.tokens for _, _, tokens in done), "short stream"
            direct, through = (
                statistics.median(walls["direct"]),
                statistics.median(walls["gateway"]),
            )
            ratios = sorted(g / d for g, d in zip(walls["gateway"], walls["direct"], strict=True))
            tokens = args.reps * concurrency * args.tokens
            results[f"wall_{concurrency}"] = {
                "direct_s": direct,
                "gateway_s": through,
                "ratio": through / direct,
                "ratio_per_rep_min_max": [ratios[0], ratios[-1]],
                "direct_runs_s": walls["direct"],
                "gateway_runs_s": walls["gateway"],
                "tokens_per_s_direct": concurrency * args.tokens / direct,
                "web_cpu_ms_per_request": cpus["gateway"] * 1000 / (args.reps * concurrency),
                # The relay's cost per token: all web processes' CPU over the tokens streamed.
                "web_cpu_us_per_token": cpus["gateway"] * 1e6 / tokens,
            }
            for name in peers:
                results[f"wall_{concurrency}"][name] = {
                    "wall_s": statistics.median(walls[name]),
                    "ratio": statistics.median(walls[name]) / direct,
                    "cpu_us_per_token": cpus[name] * 1e6 / tokens,
                }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=60, help="TTFT samples per path")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each wall-time run")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--workers", type=int, default=1, help="gateway web processes")
    parser.add_argument(
        "--litellm", action="store_true", help="LiteLLM's proxy beside it (bench.peers)"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="a pass-through relay under uvicorn beside it (bench.floor_relay)",
    )
    parser.add_argument(
        "--coalesce-ms",
        type=int,
        default=None,
        help="the gateway's INFERPLANE_STREAM_COALESCE_MS (default: its own default)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="engine alone on CPU 0; gateway and load generator on CPU 1",
    )
    args = parser.parse_args()
    django_setup()
    bench = Bench(pin=args.pin)
    try:
        engine = bench.start_engine()
        seed([engine], max_inflight=64)
        key = tenant_key("bench-overhead")
        env = {}
        if args.coalesce_ms is not None:
            env["INFERPLANE_STREAM_COALESCE_MS"] = str(args.coalesce_ms)
        gateway = bench.start_gateway(workers=args.workers, env=env)
        peers: dict[str, str] = {}
        if args.litellm:
            bench.processes["litellm"], peers["litellm"] = start_litellm(
                engine, workers=args.workers
            )
        if args.floor:
            bench.processes["floor"], peers["floor"] = start_floor(engine, workers=args.workers)
        results = asyncio.run(run(args, engine, gateway, key, bench, peers))
    finally:
        bench.stop()
    results["config"] = vars(args)
    suffix = "-pinned" if args.pin else ""
    suffix += f"-coalesce{args.coalesce_ms}" if args.coalesce_ms is not None else ""
    out = ROOT / "var" / "bench-results" / f"overhead-w{args.workers}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    t = results["ttft_ms"]
    print(
        f"TTFT one stream (ms)   direct p50 {t['direct']['p50']:.1f} p99 {t['direct']['p99']:.1f}"
        f" | gateway p50 {t['gateway']['p50']:.1f} p99 {t['gateway']['p99']:.1f}"
        f" | added p50 {results['ttft_added_ms']['p50']:+.1f} p99 "
        f"{results['ttft_added_ms']['p99']:+.1f} | web CPU "
        f"{results['web_cpu_ms_per_request_one_stream']:.1f} ms/request"
    )
    print(
        f"one stream, the whole phase: web CPU "
        f"{results['web_cpu_ms_per_request_one_stream_whole']:.2f} ms/request, "
        f"{results['web_cpu_ms_per_request_one_stream_net']:.2f} ms/request less the idle "
        f"{results['web_idle_cpu_ms_per_s']:.1f} ms/s of the web processes"
    )
    for c in (16, 64):
        w = results[f"wall_{c}"]
        print(
            f"{c:>2} concurrent x {args.tokens} tokens: direct {w['direct_s']:.2f}s, gateway "
            f"{w['gateway_s']:.2f}s, ratio {w['ratio']:.3f} (per repetition "
            f"{w['ratio_per_rep_min_max'][0]:.2f}-{w['ratio_per_rep_min_max'][1]:.2f}; "
            f"direct {w['tokens_per_s_direct']:.0f} tok/s; web CPU "
            f"{w['web_cpu_ms_per_request']:.1f} ms/request, "
            f"{w['web_cpu_us_per_token']:.0f} us/token)"
        )
        for name, title in (("litellm", "LiteLLM's proxy"), ("floor", "pass-through floor")):
            if name in w:
                peer = w[name]
                print(
                    f"   {title}: {peer['wall_s']:.2f}s, ratio {peer['ratio']:.3f}, "
                    f"CPU {peer['cpu_us_per_token']:.0f} us/token "
                    f"({peer['cpu_us_per_token'] / w['web_cpu_us_per_token']:.2f}x the gateway's)"
                )
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
