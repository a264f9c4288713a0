"""LoRA adapters through the gateway, on one vLLM CPU engine started with ``--enable-lora
--max-loras 4``, in one run:

1. First-request latency of a cold adapter against the same request warm, in interleaved
   pairs; the base model alone for reference. Cold is real: 8 adapters are cycled through a
   replica that holds 4, so each one was evicted (by the router, and from vLLM's own CPU
   cache) before it comes back, and the gateway must evict one and load it from disk
   (``POST /v1/load_lora_adapter``) before serving.
2. Throughput of N concurrent streams spread over 4 adapters (all loaded) against the same
   streams on the base model alone, interleaved repetitions.

    .venv/bin/python -m bench.lora [--pairs 12] [--streams 32] [--reps 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import aiohttp

from bench.harness import ROOT, Bench, django_setup, percentile, seed, stream_body, tenant_key

MEDIA = ROOT / "var" / "bench-media"
ADAPTERS = 8  # created; the engine holds MAX_LORAS of them at once
MAX_LORAS = 4


def _adapters(slug: str) -> list[str]:
    """Four validated adapters of the tiny model (uploaded and validated as tenants do)."""
    from django.core.files.uploadedfile import SimpleUploadedFile

    from adapters.models import Adapter
    from adapters.services import adapter_delete, adapter_upload
    from devkit.adapters import (
        TINY_CONFIG,
        config,
        lora_tensors,
        safetensors,
        scaled_weights,
    )
    from fleet.models import Model, Pool
    from tenants.models import Tenant

    Model.objects.filter(name="tiny-chat").update(supports_lora=True, architecture=TINY_CONFIG)
    Pool.objects.filter(name="online").update(max_loras=MAX_LORAS)
    tenant = Tenant.objects.get(slug=slug)
    # A version left validating by an interrupted run will not be validated (its task went
    # with the flushed Redis): set it aside so this run uploads a fresh one.
    for stuck in Adapter.objects.filter(
        tenant=tenant, status="validating", deleted_at__isnull=True
    ):
        adapter_delete(adapter=stuck, actor=None)
    weights = safetensors(lora_tensors())
    names = []
    for i in range(ADAPTERS):
        name = f"bench-{i}"
        adapter = Adapter.objects.filter(tenant=tenant, name=name, deleted_at__isnull=True).first()
        if adapter is None:
            adapter = adapter_upload(
                tenant=tenant,
                name=name,
                files={
                    "adapter_config": SimpleUploadedFile("adapter_config.json", config()),
                    "adapter_model": SimpleUploadedFile(
                        "adapter_model.safetensors", scaled_weights(weights, 1 + i)
                    ),
                },
                actor=None,
            )
        deadline = time.monotonic() + 60
        while adapter.status == "validating" and time.monotonic() < deadline:
            time.sleep(0.2)  # the gateway's Celery worker validates it
            adapter.refresh_from_db()
        assert adapter.status == "ready", adapter.reason
        names.append(f"{slug}/{name}")
    from inference.catalog import catalog_publish

    catalog_publish()
    return names


async def _stream(
    session: aiohttp.ClientSession, url: str, key: str, model: str, tokens: int
) -> tuple[float, int]:
    """(TTFT s, completion tokens) of one streamed chat completion."""
    started = time.perf_counter()
    ttft = 0.0
    count = 0
    body = stream_body(model=model, max_tokens=tokens)
    headers = {"authorization": f"Bearer {key}"}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{model}: HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                if not ttft:
                    ttft = time.perf_counter() - started
                if b'"choices":[]' in line:
                    count = json.loads(line[6:])["usage"]["completion_tokens"]
    return ttft, count


async def run(
    args: argparse.Namespace, engine: str, gateway: str, key: str, names: list[str]
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        for model in ["tiny-chat", *names]:  # warm the paths; loads every adapter once
            await _stream(session, gateway, key, model, 8)
        cold, warm, base = [], [], []
        for i in range(args.pairs):
            model = names[i % len(names)]  # last used 8 adapters ago: evicted since
            cold.append((await _stream(session, gateway, key, model, 8))[0] * 1000)
            warm.append((await _stream(session, gateway, key, model, 8))[0] * 1000)
            base.append((await _stream(session, gateway, key, "tiny-chat", 8))[0] * 1000)
        results["first_token_ms"] = {
            name: {"p50": percentile(v, 50), "p90": percentile(v, 90)}
            for name, v in (("cold", cold), ("warm", warm), ("base", base))
        }
        results["cold_over_warm_p50"] = percentile(cold, 50) / percentile(warm, 50)
        results["warm_over_base_p50"] = percentile(warm, 50) / percentile(base, 50)

        for model in names[:MAX_LORAS]:  # the mix's adapters, loaded before timing
            await _stream(session, gateway, key, model, 8)
        walls: dict[str, list[float]] = {"base": [], "mix": []}
        for rep in range(args.reps):
            for kind in ("base", "mix") if rep % 2 == 0 else ("mix", "base"):
                models = (
                    ["tiny-chat"] * args.streams
                    if kind == "base"
                    else [names[i % MAX_LORAS] for i in range(args.streams)]
                )
                started = time.perf_counter()
                done = await asyncio.gather(
                    *(_stream(session, gateway, key, m, args.tokens) for m in models)
                )
                walls[kind].append(time.perf_counter() - started)
                assert all(n == args.tokens for _, n in done), "short stream"
        tokens = args.streams * args.tokens
        base_s, mix_s = statistics.median(walls["base"]), statistics.median(walls["mix"])
        results["throughput"] = {
            "base_tokens_per_s": tokens / base_s,
            "mix_tokens_per_s": tokens / mix_s,
            "mix_over_base": base_s / mix_s,
            "base_runs_s": walls["base"],
            "mix_runs_s": walls["mix"],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=16, help="cold/warm/base samples")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each throughput run")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    args = parser.parse_args()
    os.environ["INFERPLANE_MEDIA_ROOT"] = str(MEDIA)  # this process and the gateway's
    django_setup()
    bench = Bench()
    try:
        engine = bench.start_engine(
            "--enable-lora", "--max-lora-rank", "8", "--max-loras", str(MAX_LORAS)
        )
        seed([engine], max_inflight=64)
        key = tenant_key("bench-lora")
        gateway = bench.start_gateway()
        names = _adapters("bench-lora")
        time.sleep(1.5)  # the gateway's catalog copy refreshes every second
        results = asyncio.run(run(args, engine, gateway, key, names))
    finally:
        bench.stop()
    results["config"] = vars(args)
    out = ROOT / "var" / "bench-results" / "lora.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    f, t = results["first_token_ms"], results["throughput"]
    print(
        f"first token (ms, p50/p90): cold adapter {f['cold']['p50']:.1f}/{f['cold']['p90']:.1f}"
        f" | warm adapter {f['warm']['p50']:.1f}/{f['warm']['p90']:.1f}"
        f" | base model {f['base']['p50']:.1f}/{f['base']['p90']:.1f}"
        f" | cold/warm {results['cold_over_warm_p50']:.2f}x,"
        f" warm/base {results['warm_over_base_p50']:.2f}x"
    )
    print(
        f"{args.streams} streams x {args.tokens} tokens: base {t['base_tokens_per_s']:.0f} tok/s,"
        f" 4-adapter mix {t['mix_tokens_per_s']:.0f} tok/s, mix/base {t['mix_over_base']:.2f}"
    )
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
