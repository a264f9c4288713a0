"""What a stack costs Redis: commands per second while idle, and per request, seen by
``MONITOR`` on a running stack (``make run``'s, or any other).

Idle: every command the stack's processes send to its Redis database for ``--seconds``,
by command and by caller (a client, or a Lua script: MONITOR shows the calls inside a
script as its own client ``lua``). Requests: ``--requests`` whole chat completions sent one
at a time with an API key, and the commands seen meanwhile less the idle rate, per request.
MONITOR itself costs the server time; the figures are counts, not speeds.

    .venv/bin/python -m bench.redis_cost [--url http://127.0.0.1:8000] [--key-file
        var/demo-api-key] [--redis-url $REDIS_URL] [--seconds 60] [--requests 50]
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
USAGE_STREAM = "ip:usage:stream"  # billing.spool's (not imported: this runs beside any stack)


class Tally:
    """The commands MONITOR reports for one database, counted from a thread."""

    def __init__(self, redis_url: str) -> None:
        self.db = int((urlsplit(redis_url).path or "/0").strip("/") or 0)
        self.client = redis.Redis.from_url(redis_url, socket_timeout=None)  # (MONITOR: long waits)
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        # The calls inside each script, by the script (MONITOR shows a script's EVALSHA and
        # then the calls it makes: Redis runs one at a time).
        self.by_script: collections.Counter[str] = collections.Counter()
        self.script = ""
        # Seconds from a usage record's XADD (its stream id is the server's clock, in ms) to
        # the drain's XACK of it, which follows the ledger's commit.
        self.ledger_lags: list[float] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _watch(self) -> None:
        with self.client.monitor() as monitor:  # type: ignore[no-untyped-call]
            self.ready.set()
            for event in monitor.listen():
                if self.stop.is_set():
                    return
                if int(event.get("db", -1)) != self.db:
                    continue
                caller = "lua" if event.get("client_type") == "lua" else "client"
                words = str(event["command"]).split(" ")
                name = words[0].upper()
                with self.lock:
                    self.counts[(caller, name)] += 1
                    if caller == "client" and name in ("EVALSHA", "EVAL") and len(words) > 1:
                        self.script = words[1].strip('"')[:8] if name == "EVALSHA" else "eval"
                        self.by_script[f"{self.script} runs"] += 1
                    elif caller == "lua":
                        self.by_script[f"{self.script} calls"] += 1
                    if name == "XACK" and len(words) > 3 and words[1] == USAGE_STREAM:
                        acked = float(event["time"])
                        for entry in words[3:]:
                            self.ledger_lags.append(acked - int(entry.split("-")[0]) / 1000)

    def take(self) -> collections.Counter[tuple[str, str]]:
        """What was counted since the last take (and start counting afresh)."""
        with self.lock:
            counts, self.counts = self.counts, collections.Counter()
            self.by_script = collections.Counter()
        return counts

    def take_scripts(self) -> collections.Counter[str]:
        with self.lock:
            counts, self.by_script = self.by_script, collections.Counter()
        return counts


def _script_names() -> dict[str, str]:
    """The gateway's scripts by the start of their SHA (empty when the project cannot load)."""
    try:
        import django

        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        django.setup()
        from inference.gateway import cache, cache_semantic, limits, lora
        from inference.gateway.admission import scripts as admission
        from inference.gateway.lua import Script
    except Exception:  # a stack of another checkout: SHAs only
        return {}
    return {
        value.sha[:8]: value.name
        for module in (admission, cache, cache_semantic, limits, lora)
        for value in vars(module).values()
        if isinstance(value, Script)
    }


def _table(counts: collections.Counter[tuple[str, str]], per: float, unit: str) -> None:
    for caller in ("client", "lua"):
        rows = [(name, n) for (c, name), n in counts.items() if c == caller]
        total = sum(n for _, n in rows)
        print(f"  {caller:6} {total / per:8.2f} {unit}")
        for name, n in sorted(rows, key=lambda row: -row[1])[:30]:
            print(f"         {name:18} {n / per:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key-file", default=str(ROOT / "var" / "demo-api-key"))
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--model", default="tiny-chat")
    args = parser.parse_args()

    tally = Tally(args.redis_url)
    time.sleep(args.seconds)
    idle = tally.take()
    idle_rate = {k: n / args.seconds for k, n in idle.items()}
    print(f"idle, {args.seconds:.0f} s: commands per second")
    _table(idle, args.seconds, "/s")
    if not args.requests:
        return

    key = Path(args.key_file).read_text().strip()
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 4,
    }
    with httpx.Client(base_url=args.url, headers={"authorization": f"Bearer {key}"}) as http:
        http.post("/v1/chat/completions", json=body, timeout=60).raise_for_status()  # warm
        tally.take()
        started = time.monotonic()
        for _ in range(args.requests):
            http.post("/v1/chat/completions", json=body, timeout=60).raise_for_status()
        elapsed = time.monotonic() - started
    scripts = tally.take_scripts()
    seen = tally.take()
    time.sleep(3)  # the drain's last acknowledgements
    tally.stop.set()
    net: collections.Counter[tuple[str, str]] = collections.Counter()
    for k in set(seen) | set(idle_rate):
        n = seen.get(k, 0) - idle_rate.get(k, 0) * elapsed
        if n > 0:
            net[k] = round(n)
    print(f"{args.requests} requests (idle rate subtracted): commands per request")
    _table(net, args.requests, "/request")
    names = _script_names()
    print("  by script: runs and the calls inside, per request")
    for label, n in sorted(scripts.items(), key=lambda row: -row[1]):
        sha, _, what = label.partition(" ")
        print(f"         {names.get(sha, sha):20} {what:5} {n / args.requests:8.2f}")
    lags = sorted(tally.ledger_lags)
    if lags:
        p50, worst = lags[len(lags) // 2], lags[-1]
        print(
            "usage record, spooled -> in the ledger: "
            f"p50 {p50 * 1000:.0f} ms, max {worst * 1000:.0f} ms"
        )


if __name__ == "__main__":
    main()
