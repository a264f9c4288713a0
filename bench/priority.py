"""Priority and lending on one online engine (docs/priority.md), same run:

(b) with the online pool idle, one batch of ``--lines`` lines (``--max-tokens`` each) run
    on the spot pool alone (the online pool lends nothing), then with the online pool lending
    all its room (spot + online), twice each. The ratio of the best times (goal: >= 1.8x
    faster with lending).
(c) after each batch: every line once in the output, and the ledger equal to the output's
    usage (tokens and request ids).
(a) then the spot pool is removed and its engine stopped, and interactive requests arrive at
    random (Poisson, ``--rate`` per second, streamed, ``--online-tokens`` each) on the online
    pool for ``--seconds``: alone, then while a batch runs on the room that pool lends
    (``--lend`` percent), ``--rounds`` times. TTFT p50/p99 of each, and the ratio (goal: p99
    with lending <= 1.25x without).

Two engines, each alone on a core (``Bench.start_engine(core=...)``: two machines' worth of
engine on this one), the gateway, its workers and the load generator beside them.

    .venv/bin/python -m bench.priority [--lines 160] [--seconds 30] [--rate 4] [--lend 25]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from bench.harness import ROOT, Bench, django_setup, percentile, seed, tenant_key


def _jsonl(lines: int, max_tokens: int, tag: str) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"{tag}{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny-chat",
                    "messages": [{"role": "user", "content": f"Write line {i} of a poem."}],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            }
        )
        + b"\n"
        for i in range(lines)
    )


def _pools(engine_online: str, engine_spot: str, *, online: int, spot: int) -> None:
    from fleet.models import Model, Pool, Replica
    from inference.catalog import catalog_publish
    from inference.services import pool_ensure, replica_probe

    seed([engine_online], max_inflight=online)
    pool = pool_ensure(
        name="spot",
        kind="spot",
        model=Model.objects.get(name="tiny-chat"),
        replica_urls=[engine_spot],
    )
    Pool.objects.filter(pk=pool.pk).update(max_inflight=spot, max_queue_wait_seconds=600)
    for replica in Replica.objects.filter(pool=pool):
        replica_probe(replica=replica)
    catalog_publish()


def _lend(percent: int) -> None:
    from fleet.models import Pool
    from inference.services import pool_configure

    pool_configure(pool=Pool.objects.get(name="online"), lend_percent=percent)
    time.sleep(1.5)  # every process's copy of the catalog


def _start_batch(client: Any, lines: int, max_tokens: int, tag: str) -> str:
    uploaded = client.files.create(
        file=(f"{tag}.jsonl", io.BytesIO(_jsonl(lines, max_tokens, tag))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return str(batch.id)


def _finish(client: Any, batch_id: str, lines: int) -> dict[str, Any]:
    """Waits for the batch; checks (c): every line once, the ledger equal to the output."""
    from billing.models import UsageRecord

    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in {"completed", "failed", "cancelled", "expired"}:
            break
        time.sleep(0.25)
    if batch.status != "completed" or batch.request_counts.completed != lines:
        raise SystemExit(f"the batch did not complete: {batch}")
    output = [
        orjson.loads(x) for x in client.files.content(batch.output_file_id).content.splitlines()
    ]
    ids = [o["custom_id"] for o in output]
    once = len(ids) == len(set(ids)) == lines
    rids = sorted(o["response"]["request_id"] for o in output)
    records = UsageRecord.objects.filter(request_id__in=rids)
    # The ledger is written by the usage flusher: within seconds.
    for _ in range(100):
        if records.count() == lines:
            break
        time.sleep(0.1)
    tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output)
    ledger = sum(records.values_list("completion_tokens", flat=True))
    pools = dict.fromkeys(records.values_list("pool", flat=True).distinct(), 0)
    for pool in pools:
        pools[pool] = records.filter(pool=pool).count()
    return {
        "once": once,
        "ledger_equal": ledger == tokens
        and sorted(records.values_list("request_id", flat=True)) == rids,
        "tokens": tokens,
        "by_pool": pools,
    }


async def _interactive(
    gateway: str,
    key: str,
    seconds: float,
    rate: float,
    tokens: int,
    sample: Callable[[], None] | None = None,
) -> list[float]:
    """Poisson arrivals for ``seconds``; the TTFT (ms) of each, streamed. ``sample`` runs
    at each arrival."""
    rng = random.Random(7)
    ttfts: list[float] = []
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Answer briefly: what is fair queuing?"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "service_tier": "priority",
    }
    headers = {"authorization": f"Bearer {key}"}

    async def one(session: aiohttp.ClientSession) -> None:
        started = time.perf_counter()
        async with session.post(f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200:
                raise SystemExit(f"interactive request: HTTP {r.status} {await r.text()}")
            first = None
            async for line in r.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter()
            ttfts.append(((first or time.perf_counter()) - started) * 1000)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tasks.append(asyncio.ensure_future(one(session)))
            if sample is not None:
                sample()
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return ttfts


async def _direct(engines: list[str], lines: int, max_tokens: int, width: int) -> float:
    """The same lines straight to the engines, ``width`` at a time on each (a line goes to
    whichever engine has a free place first): the machine's own ceiling for (b)."""
    from inference.engine_auth import engine_auth_headers

    places: asyncio.Queue[str] = asyncio.Queue()
    for engine in engines:
        for _ in range(width):
            places.put_nowait(engine)
    body = orjson.loads(_jsonl(1, max_tokens, "d"))["body"]

    async def one(session: aiohttp.ClientSession) -> None:
        engine = await places.get()
        try:
            url = f"{engine}/v1/chat/completions"
            async with session.post(url, json=body, headers=engine_auth_headers()) as response:
                assert (await response.json())["usage"]["completion_tokens"] == max_tokens
        finally:
            places.put_nowait(engine)

    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(one(session) for _ in range(lines)))
    return time.monotonic() - started


def _reclaimed() -> int:
    from inference.gateway.admission import queue_state

    return queue_state("online").reclaimed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--online-tokens", type=int, default=16)
    parser.add_argument("--lend", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--inflight", type=int, default=16, help="each pool's sequences")
    args = parser.parse_args()

    django_setup()
    bench = Bench()
    results: dict[str, Any] = {"args": vars(args)}
    try:
        online_engine = bench.start_engine(core=0)
        spot_engine = bench.start_engine(core=1)
        _pools(online_engine, spot_engine, online=args.inflight, spot=args.inflight)
        gateway = bench.start_gateway(workers=2, batch_workers=1)
        import openai

        batch_key = tenant_key("bench-priority-batch")
        client = openai.OpenAI(api_key=batch_key, base_url=f"{gateway}/v1", max_retries=2)
        online_key = tenant_key("bench-priority-online")
        from inference.gateway.admission import queue_state
        from tenants.models import Tenant

        Tenant.objects.filter(slug="bench-priority-online").update(priority_class="interactive")
        time.sleep(1.5)
        # Warm both engines and the gateway.
        _finish(client, _start_batch(client, 32, 8, "warm"), 32)
        asyncio.run(_interactive(gateway, online_key, 3, args.rate, args.online_tokens))

        # (b) + (c): spot alone, then spot + the idle online pool lending all of its room.
        times: dict[str, list[float]] = {"spot": [], "lending": []}
        checks = []
        engines = {"one engine": [spot_engine], "two engines": [spot_engine, online_engine]}
        ceiling = {
            name: min(
                asyncio.run(_direct(urls, args.lines, args.max_tokens, args.inflight))
                for _ in range(2)
            )
            for name, urls in engines.items()
        }
        print(f"straight to the engines (the machine's ceiling): {ceiling}", flush=True)
        for rep in range(2):
            for mode, percent in (("spot", 0), ("lending", 100)):
                _lend(percent)
                started = time.monotonic()
                done = _finish(
                    client,
                    _start_batch(client, args.lines, args.max_tokens, f"{mode}{rep}-"),
                    args.lines,
                )
                times[mode].append(time.monotonic() - started)
                checks.append({"mode": mode, **done})
                print(
                    f"batch of {args.lines} lines, {mode}: {times[mode][-1]:.1f}s; {done}",
                    flush=True,
                )
        spot_s, lending_s = min(times["spot"]), min(times["lending"])
        results["batch"] = {
            "spot_s": times["spot"],
            "lending_s": times["lending"],
            "checks": checks,
            "ceiling_s": ceiling,
        }

        # (a): one online engine, interactive requests alone, then beside batch lines lent
        # to it (the batch has no spot pool now: it runs on lent room alone, so what the
        # interactive requests feel is the lending, not another engine on the machine).
        from fleet.models import Pool
        from inference.catalog import catalog_publish

        Pool.objects.filter(name="spot").delete()
        catalog_publish()
        bench.stop_engine(spot_engine)
        _lend(args.lend)
        alone: list[float] = []
        beside: list[float] = []
        reclaimed = 0
        lent_seen: list[int] = []
        for _ in range(args.rounds):
            alone += asyncio.run(
                _interactive(gateway, online_key, args.seconds, args.rate, args.online_tokens)
            )
            # Enough lines to outlast the interactive run many times over (cancelled after).
            batch_id = _start_batch(client, 20_000, args.max_tokens, "beside-")
            while queue_state("online").lent == 0:  # lines are lent before the clock starts
                time.sleep(0.05)
            before = _reclaimed()
            beside += asyncio.run(
                _interactive(
                    gateway,
                    online_key,
                    args.seconds,
                    args.rate,
                    args.online_tokens,
                    sample=lambda: lent_seen.append(queue_state("online").lent),
                )
            )
            reclaimed += _reclaimed() - before
            if client.batches.retrieve(batch_id).status != "in_progress":
                raise SystemExit("the batch beside the interactive load ended before it did")
            client.batches.cancel(batch_id)
            while sum(queue_state("online").in_flight.values()):  # its lent lines finish
                time.sleep(0.1)
        results["ttft"] = {
            "alone": alone,
            "beside": beside,
            "reclaimed": reclaimed,
            "lent_seen": lent_seen,
        }
    finally:
        bench.stop()

    p50a, p99a = percentile(alone, 50), percentile(alone, 99)
    p50b, p99b = percentile(beside, 50), percentile(beside, 99)
    print(f"(a) interactive TTFT alone: p50 {p50a:.1f} ms, p99 {p99a:.1f} ms ({len(alone)})")
    print(
        f"    beside lent batch lines: p50 {p50b:.1f} ms, p99 {p99b:.1f} ms ({len(beside)}; "
        f"{reclaimed} lent taken back; sequences lent at arrivals: "
        f"median {percentile([float(n) for n in lent_seen], 50):.0f})"
    )
    print(f"    p99 ratio {p99b / p99a:.2f} (goal <= 1.25); p50 ratio {p50b / p50a:.2f}")
    print(
        f"(b) {args.lines} lines: spot alone {spot_s:.1f}s, spot + lending {lending_s:.1f}s: "
        f"{spot_s / lending_s:.2f}x faster (goal >= 1.8)"
    )
    most = ceiling["one engine"] / ceiling["two engines"]
    print(
        f"    straight to the engines, one {ceiling['one engine']:.1f}s, two "
        f"{ceiling['two engines']:.1f}s: this machine runs two engines {most:.2f}x as fast as "
        f"one; lending reaches {(spot_s / lending_s) / most:.0%} of that"
    )
    ok = all(c["once"] and c["ledger_equal"] for c in checks)
    print(f"(c) every line once, the ledger equal to the output: {ok} ({len(checks)} batches)")
    out = ROOT / "var" / "bench-results" / "priority.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
