"""A tenant hammering the guard model, and what another tenant's moderation feels of it.

The guard pool is shared: every tenant whose policy names the guard model, and every
``/v1/moderations`` call naming it, goes to its engines. Its calls are admitted by the
gateway's fair admission (a tenant's turn by the tokens it sends) and a huge text goes as
several calls of ``PIECES_PER_CALL`` pieces (``moderation.cascade``). Here one tenant
("noisy") keeps ``--noisy`` calls in flight, each of ``--inputs`` texts of ``--chars``
characters, while another ("quiet") asks for one short text at a time; before the noise,
the quiet tenant's same requests give the floor. Reported: the quiet tenant's latency p50,
p90, p99 alone and under the noise and their ratios (goal: p99 ratio below 1.2), whether its
verdicts changed at all (goal: not one score; a request the guard did not answer in time, a
503, counts as changed), and the guard engine's throughput meanwhile.

    .venv/bin/python -m bench.guard_isolation [--samples 100] [--noisy 8] [--inputs 32]
        [--chars 8000] [--max-inflight 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

from bench.harness import ROOT, Bench, django_setup, percentile, tenant_key

QUANTILES = (50, 90, 99)
QUIET_TEXTS = ["a fox in the woods", "a dog in the woods", "calm sea and quick wind"]


async def _ask(session: aiohttp.ClientSession, url: str, key: str, texts: Any) -> Any:
    """The answer, or None when the gateway answered an error (the guard did not answer)."""
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": "tiny-guard", "input": texts}
    async with session.post(url, json=body, headers=headers) as response:
        return await response.json() if response.status == 200 else None


async def _quiet(
    session: aiohttp.ClientSession, url: str, key: str, samples: int
) -> tuple[list[float], list[Any]]:
    """Latencies (ms) and the scores of each of the quiet tenant's requests, one at a time
    (None for one that got an error: the guard did not answer it in time)."""
    took, scores = [], []
    for i in range(samples):
        text = QUIET_TEXTS[i % len(QUIET_TEXTS)]
        started = time.perf_counter()
        answer = await _ask(session, url, key, text)
        took.append((time.perf_counter() - started) * 1000)
        scores.append((text, answer["results"][0]["category_scores"] if answer else None))
    return took, scores


async def _noisy_forever(
    session: aiohttp.ClientSession, url: str, key: str, texts: list[str], done: list[int]
) -> None:
    while True:
        await _ask(session, url, key, texts)
        done[0] += 1


def _summary(values: list[float]) -> dict[str, float]:
    return {f"p{q}": round(percentile(values, q), 1) for q in QUANTILES}


async def _engine_tokens(session: aiohttp.ClientSession, engine: str) -> float:
    """The guard engine's prompt tokens so far (its own counter)."""
    async with session.get(f"{engine}/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_total")
    )


async def run(args: argparse.Namespace, gateway: str, engine: str, quiet: str, noisy: str) -> Any:
    url = f"{gateway}/v1/moderations"
    texts = [("calm sea and a dog " * (args.chars // 19 + 1))[: args.chars]] * args.inputs
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await _quiet(session, url, quiet, 10)  # warm: the engine's first calls, the gateway's
        alone, alone_scores = await _quiet(session, url, quiet, args.samples)
        done = [0]
        hammer = [
            asyncio.create_task(_noisy_forever(session, url, noisy, texts, done))
            for _ in range(args.noisy)
        ]
        try:
            await asyncio.sleep(3)  # the noise is under way: every slot is the noisy tenant's
            started, before = time.perf_counter(), await _engine_tokens(session, engine)
            noisy_took, noisy_scores = await _quiet(session, url, quiet, args.samples)
            tokens = await _engine_tokens(session, engine) - before
            elapsed = time.perf_counter() - started
        finally:
            for task in hammer:
                task.cancel()
            await asyncio.gather(*hammer, return_exceptions=True)
    changed = sum(1 for a, b in zip(alone_scores, noisy_scores, strict=True) if a != b)
    failed = sum(1 for _, answer in noisy_scores if answer is None)
    return {
        "quiet_alone_ms": _summary(alone),
        "quiet_under_noise_ms": _summary(noisy_took),
        "ratios": {
            f"p{q}": round(percentile(noisy_took, q) / percentile(alone, q), 2) for q in QUANTILES
        },
        "verdicts_changed": changed,
        "quiet_failed_under_noise": failed,
        "guard_tokens_per_s_under_noise": round(tokens / elapsed),
        "noisy_chars_per_call": args.inputs * args.chars,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100, help="quiet requests per phase")
    parser.add_argument("--noisy", type=int, default=8, help="noisy calls in flight")
    parser.add_argument("--inputs", type=int, default=32, help="texts per noisy call")
    parser.add_argument("--chars", type=int, default=8000, help="characters per noisy text")
    parser.add_argument("--max-inflight", type=int, default=4, help="the guard pool's slots")
    args = parser.parse_args()
    django_setup()
    bench = Bench()
    try:
        guard = bench.start_guard_engine(core=1)
        from fleet.models import Model, Pool, Replica
        from inference.catalog import catalog_publish
        from inference.services import model_ensure, pool_ensure, replica_probe

        model = model_ensure(name="tiny-guard", served_name="tiny-guard", context_length=1024,
                             task=Model.Task.CLASSIFY)  # fmt: skip
        pool = pool_ensure(name="guard", kind="dedicated", model=model, replica_urls=[guard])
        Pool.objects.filter(pk=pool.pk).update(max_inflight=args.max_inflight)
        for replica in Replica.objects.filter(pool__name="guard"):
            replica_probe(replica=replica)
        catalog_publish()
        quiet, noisy = tenant_key("bench-guard-quiet"), tenant_key("bench-guard-noisy")
        gateway = bench.start_gateway()
        results: dict[str, Any] = asyncio.run(run(args, gateway, guard, quiet, noisy))
    finally:
        bench.stop()
    results["config"] = vars(args)
    out = ROOT / "var" / "bench-results" / "guard_isolation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    a, n, r = results["quiet_alone_ms"], results["quiet_under_noise_ms"], results["ratios"]
    print(
        f"quiet tenant (ms): alone p50 {a['p50']} p99 {a['p99']} | under noise p50 {n['p50']} "
        f"p99 {n['p99']} | ratio p50 {r['p50']} p99 {r['p99']} (goal p99 < 1.2) | verdicts "
        f"changed: {results['verdicts_changed']} ({results['quiet_failed_under_noise']} "
        f"failed) | the guard engine's throughput meanwhile "
        f"{results['guard_tokens_per_s_under_noise']:,} tokens/s (noisy calls of "
        f"{results['noisy_chars_per_call']:,} characters)"
    )


if __name__ == "__main__":
    main()
