"""Load on one engine: K long streams of another tenant, restarted as each ends.

What the timing-sensitive tests must survive (tests/README.md, "Under load"): the engine
they use is busy with somebody else's long answers, so every step of theirs takes longer
and lands at a different moment. The streams go straight to the engine with a prefix-cache
salt of their own (another tenant's, as the gateway would send it), ask for ``ignore_eos``
so each runs its full length, and start again as each ends.

Its output, one line each:
- ``streaming`` once every stream has its first token (the engine is busy from then on);
- on SIGUSR1 it drains: no new stream starts, the running ones finish (never aborted), then
  one JSON line with the prompt and completion tokens of every stream so far, each the
  engine's own usage report. A test that compares the engine's counters subtracts these
  (tests/live.py ``settled_counters``): what the load made is known exactly;
- on SIGUSR2 it starts again (``streaming`` once every stream is under way);
- at the end (SIGTERM, SIGINT or ``--seconds``) one JSON line: streams finished, tokens,
  tokens per second.

    .venv/bin/python -m bench.engine_load --url http://127.0.0.1:8100 [--streams 4]
        [--tokens 300] [--seconds 0] [--key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from typing import Any

import aiohttp

from bench.harness import stream_body

SALT = "bench-engine-load"


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.url = f"{args.url}/v1/chat/completions"
        self.headers = {"authorization": f"Bearer {args.key}"} if args.key else {}
        self.body = stream_body(max_tokens=args.tokens, cache_salt=SALT)
        self.running = asyncio.Event()
        self.active = 0
        self.idle = asyncio.Event()
        self.streamed: set[int] = set()  # the streams with a token since the last start
        self.totals = {"streams_finished": 0, "prompt_tokens": 0, "completion_tokens": 0}
        self.tokens = 0  # chunks with content received: the rate, not the bill

    async def stream_forever(self, session: aiohttp.ClientSession, index: int) -> None:
        while True:
            await self.running.wait()
            self.active += 1
            self.idle.clear()
            try:
                usage = await self._one(session, index)
            finally:
                self.active -= 1
                if not self.active:
                    self.idle.set()
            self.totals["streams_finished"] += 1
            self.totals["prompt_tokens"] += usage["prompt_tokens"]
            self.totals["completion_tokens"] += usage["completion_tokens"]

    async def _one(self, session: aiohttp.ClientSession, index: int) -> dict[str, int]:
        usage: dict[str, int] = {}
        async with session.post(self.url, json=self.body, headers=self.headers) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                if b'"content"' in line:
                    self.tokens += 1
                    if index not in self.streamed:
                        self.streamed.add(index)
                        if len(self.streamed) == self.args.streams:
                            print("streaming", flush=True)
                if b'"usage":{' in line or b'"usage": {' in line:
                    usage = json.loads(line[len(b"data: ") :])["usage"] or usage
        if not usage:
            raise RuntimeError("a stream ended without the engine's usage report")
        return usage

    def start(self) -> None:
        self.streamed.clear()
        self.running.set()

    async def drain(self) -> None:
        self.running.clear()
        if self.active:
            await self.idle.wait()
        print(json.dumps({"drained": True, **self.totals}), flush=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load = Load(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: asyncio.ensure_future(load.drain()))
    loop.add_signal_handler(signal.SIGUSR2, load.start)
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        load.start()
        streams = [
            asyncio.create_task(load.stream_forever(session, i)) for i in range(args.streams)
        ]
        waits = [asyncio.create_task(stop.wait()), *streams]
        if args.seconds:
            waits.append(asyncio.create_task(asyncio.sleep(args.seconds)))
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
        failed = [task.exception() for task in done if task in streams and not task.cancelled()]
    elapsed = time.monotonic() - started
    result: dict[str, Any] = {
        "streams": args.streams,
        **load.totals,
        "tokens_received": load.tokens,
        "tokens_per_s": round(load.tokens / elapsed, 1) if elapsed else 0.0,
        "seconds": round(elapsed, 1),
    }
    if failed:
        result["error"] = repr(failed[0])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the engine, e.g. http://127.0.0.1:8100")
    parser.add_argument("--streams", type=int, default=4, help="long streams at once")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per stream")
    parser.add_argument("--seconds", type=float, default=0, help="stop after this (0: never)")
    parser.add_argument("--key", default="", help="the engine's API key")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result), flush=True)
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
