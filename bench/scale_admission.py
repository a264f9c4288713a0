"""Admission, limits and key authentication at scale: what one Redis shard does per request
as tenants and keys grow. Called by ``bench.scale``; each function returns a dict of figures.

``admission(quick, redis_url)``: the gateway's own admission scripts (ENQUEUE and COMPLETE
of ``inference.gateway.admission``, called through the project's ``Script`` and ``Batch`` with
``Admission``'s argument layout) driven flat out against one Redis database by simulated web
processes (8, each with its grant listener, BLPOP as ``Admission._listen`` does, and 4
request loops). One VTC pool of 4 replicas x 16 sequences, written as ``catalog_publish``
writes it: with no ready replica while the backlog is made, then with its capacity and a TICK
(so no tenant starts ahead of the others); 10, 1,000 and 100,000 tenants (quick: 10, 1,000,
10,000), every one backlogged all along (closed loop: a request's completion enqueues its
tenant's next request, so every COMPLETE admits the head of the smallest-counter tenant and
every ENQUEUE queues), 20,000 requests outstanding at least (quick: 10,000: their heads have
waited longer than BACKFILL_MS, at every tenant count). Per tenant count: admissions/s;
p50/p99 of each script call measured by the client (with 32 calls in flight from one event
loop: mostly the client's own queueing); the same calls measured by Redis (``INFO
commandstats``/``latencystats`` after ``CONFIG RESETSTAT``, which also count the commands
the scripts run inside, and, per script, ``SLOWLOG`` sampled in a second window, filtered by
the pool's key); Redis's main-thread CPU over the window. The figure asked for: Redis time
per admission at the largest tenant count over the same at 10 tenants (run first and again
last: the mean, and the drift between them), in the same run (VTC picks the smallest counter
from a zset: O(log n), so the ratio should stay near 1). Also 10 tenants with a shallow
backlog (heads younger than BACKFILL_MS: a dispatch that finds no room scans the next
BACKFILL_SCAN tenants). Then the limits scripts (ACQUIRE and RELEASE, through
``limits.acquire`` and ``Grant.release_into``) on random tenants among 1,000 and 100,000
(quick: 10,000), each tenant with rate, concurrency and monthly-budget limits.

``keys(quick, database_url, redis_url)``: ``authenticate`` (``inference.gateway.auth``) over
1,000,000 keys (quick: 100,000; 10 keys per tenant), in a database of the bench's own (built
with one ``INSERT ... SELECT generate_series``, kept while it holds exactly these rows: the
ledger part of ``bench.scale`` empties the same tables): the in-process hit; the Redis hit
(process cache cold) against the Postgres path (Redis cold, a lookup among all the rows);
Redis memory per cached key (entries written as ``auth._load`` writes them, ``used_memory``
delta) against the Postgres table's size; the process's memory per cached key (tracemalloc
over 10,000 distinct keys). Per-request costs are set beside the gateway's own CPU per
request (``bench/RESULTS.md``).

Redis's statistics (commandstats, latencystats, slowlog) are the whole server's: another
client using Redis at the same time shows up in commandstats (``foreign_evalsha_calls``
says how many calls were not this bench's, give or take the calls in flight at the window's
edges); the slowlog figures are filtered to this bench's keys. The slowlog settings are
changed for a second or two per phase and put back.

    .venv/bin/python -m bench.scale_admission      (both, quick, printed as JSON)
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import random
import statistics
import time
import tracemalloc
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio as aioredis

from bench.harness import percentile

if TYPE_CHECKING:
    from inference.gateway.admission import Admission
    from inference.gateway.auth import KeyInfo

POOL = "scale-bench"
REPLICAS = 4
SLOTS = 16  # max_inflight of each replica: 64 sequences in the pool
PROCESSES = 8  # simulated web processes, each with its own grants list and listener
LOOPS = 4  # request loops per process
PROMPT, COMPLETION = 500, 200  # tokens of every simulated request
WAIT_MS = 600_000  # a queued request's deadline: longer than any phase
LIMIT_TENANT0 = 900_000_000  # the limits phase's tenant ids: keys no one else uses
GATEWAY_CPU_MS = 5.4  # web CPU per streamed request, one stream (bench/RESULTS.md, session 10)


def _us(seconds: list[float], q: float) -> float:
    return round(percentile(seconds, q) * 1e6, 1)


def _dist(micros: list[float]) -> dict[str, float]:
    if not micros:
        return {"n": 0}
    return {
        "n": len(micros),
        "p50_us": round(percentile(micros, 50), 1),
        "p99_us": round(percentile(micros, 99), 1),
        "mean_us": round(statistics.fmean(micros), 2),
    }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _django(redis_url: str, database_url: str | None = None) -> None:
    """Django set up (once per process) with this Redis and, when given, this database."""
    from django.apps import apps

    if not apps.ready:
        os.environ["REDIS_URL"] = redis_url
        if database_url:
            os.environ["DATABASE_URL"] = database_url
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        import django

        django.setup()
    from django.conf import settings

    from inference.gateway.redis import state_use

    if redis_url != settings.REDIS_URL:  # set up by someone else: the hot path's clients
        settings.REDIS_URL = redis_url  # are made per event loop, from this
    state_use(redis_url)
    if database_url:
        from django.db import connections

        from controlplane.env import env_database

        os.environ["DATABASE_URL"] = database_url
        wanted = env_database("DATABASE_URL", database_url)
        current = connections["default"].settings_dict
        if (current["ENGINE"], current["NAME"]) != (wanted["ENGINE"], wanted["NAME"]):
            connections.close_all()
            settings.DATABASES["default"] = wanted
            connections.settings = connections.configure_settings(settings.DATABASES)
            del connections["default"]


def _admin(redis_url: str) -> Any:
    """A synchronous client for a phase's set-up and reads: the Redis, or the cluster."""
    from controlplane.redis import cluster_seed

    seed = cluster_seed(redis_url)
    return redis.Redis.from_url(redis_url) if seed is None else redis.RedisCluster.from_url(seed)


def _servers(admin: Any, key: str | None = None) -> list[redis.Redis]:
    """The servers whose statistics a phase reads: the one Redis; on a cluster the master
    holding ``key`` (a pool's keys are one slot), or every master (tenants spread)."""
    if not isinstance(admin, redis.RedisCluster):
        return [admin]
    cluster: Any = admin  # (redis-py's sync cluster methods are untyped)
    nodes = [cluster.get_node_from_key(key)] if key else cluster.get_primaries()
    return [redis.Redis(host=node.host, port=node.port) for node in nodes]


def _url(server: redis.Redis) -> str:
    kwargs = server.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"


# --- Redis's own view of a phase -----------------------------------------------------------
class _Server:
    """Redis's statistics over a window: CPU, commands (also those run inside scripts), of
    one server or summed over a cluster's masters (latency percentiles: the first one's)."""

    def __init__(self, clients: list[redis.Redis]) -> None:
        self.clients = clients
        self.cpu0 = self.t0 = 0.0

    def _cpu(self) -> float:
        total = 0.0
        for client in self.clients:
            info: dict[str, Any] = client.info("cpu")
            user = info.get("used_cpu_user_main_thread", info["used_cpu_user"])
            total += float(info.get("used_cpu_sys_main_thread", info["used_cpu_sys"]))
            total += float(user)
        return total

    def begin(self) -> None:
        for client in self.clients:
            client.config_resetstat()
        self.cpu0, self.t0 = self._cpu(), time.perf_counter()

    def _commandstats(self) -> tuple[dict[str, dict[str, float]], list[int]]:
        """Every command's calls and µs, summed; and each server's EVALSHA calls."""
        summed: dict[str, dict[str, float]] = {}
        evalsha: list[int] = []
        for client in self.clients:
            stats: dict[str, Any] = client.info("commandstats")
            evalsha.append(int(stats.get("cmdstat_evalsha", {}).get("calls", 0)))
            for name, v in stats.items():
                into = summed.setdefault(name, {"calls": 0, "usec": 0})
                into["calls"] += v["calls"]
                into["usec"] += v["usec"]
        return summed, evalsha

    def end(self, script_calls: int, events: int) -> dict[str, Any]:
        """``script_calls``: this bench's EVALSHA calls in the window; ``events``: what it
        counts per (admissions, cycles), to divide Redis's time and CPU by."""
        wall = time.perf_counter() - self.t0
        cpu = self._cpu() - self.cpu0
        stats, per_server = self._commandstats()
        latency: dict[str, Any] = self.clients[0].info("latencystats")
        evalsha = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
        pct = latency.get("latency_percentiles_usec_evalsha", {})
        per = max(events, 1)
        inner = sorted(
            (
                (name.removeprefix("cmdstat_"), v["calls"] / per, v["usec"] / per)
                for name, v in stats.items()
                if name not in ("cmdstat_evalsha", "cmdstat_info", "cmdstat_config|resetstat")
            ),
            key=lambda item: -item[2],
        )
        return {
            "wall_s": round(wall, 2),
            "redis_cpu_fraction": round(cpu / wall, 3),
            "redis_cpu_us_per_event": round(cpu * 1e6 / max(events, 1), 1),
            "evalsha_calls": evalsha["calls"],
            "foreign_evalsha_calls": evalsha["calls"] - script_calls,
            "evalsha_usec_per_call": round(evalsha["usec"] / max(evalsha["calls"], 1), 2),
            "evalsha_server_p50_us": pct.get("p50", 0.0),
            "evalsha_server_p99_us": pct.get("p99", 0.0),
            "script_us_per_event": round(evalsha["usec"] / max(events, 1), 2),
            "servers": len(self.clients),
            # how the script calls spread over the servers (a cluster's masters)
            "evalsha_share_per_server": [round(n / max(sum(per_server), 1), 3) for n in per_server],
            # the commands run (inside the scripts, and BLPOP), by their time per event (top
            # 8): [calls per event, µs per event]; another client's commands would show here
            "commands_per_event": {
                name: [round(calls, 2), round(us, 2)] for name, calls, us in inner[:8]
            },
        }


async def _slowlog(
    redis_url: str, seconds: float, classify: Callable[[list[bytes]], str | None]
) -> dict[str, list[float]]:
    """Every command's execution time (µs) Redis logs over ``seconds``, by ``classify``'s
    name (None: not ours). SLOWLOG logs all commands for that long, then its settings are
    put back."""
    client = aioredis.Redis.from_url(redis_url)
    before = {_text(k): _text(v) for k, v in (await client.config_get("slowlog-*")).items()}
    found: dict[str, list[float]] = {}
    try:
        await client.config_set("slowlog-max-len", 4096)
        await client.config_set("slowlog-log-slower-than", 0)
        await client.slowlog_reset()
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            await asyncio.sleep(0.1)
            entries = await client.slowlog_get(4096)
            await client.slowlog_reset()
            for entry in entries:
                name = classify(entry["command"].split(b" "))
                if name:
                    found.setdefault(name, []).append(float(entry["duration"]))
    finally:
        for key, value in before.items():
            await client.config_set(key, value)
        await client.slowlog_reset()
        await client.aclose()
    return found


# --- admission -----------------------------------------------------------------------------


class _Load:
    """What the request loops record while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.stop = False
        self.enqueue: list[float] = []
        self.complete: list[float] = []
        self.granted_at_enqueue = 0  # slots taken at once (a hold): not the backlogged path

    def reset(self, on: bool) -> None:
        self.on = on
        self.enqueue, self.complete, self.granted_at_enqueue = [], [], 0


def _prefix_of(tenant: int) -> str:
    """A prompt-prefix hash as the request parser makes one (per tenant: its system prompt)."""
    return hashlib.blake2b(str(tenant).encode(), digest_size=8).hexdigest()


async def _admission_phase(
    tenants: int, redis_url: str, seconds: float, backlog: int
) -> dict[str, Any]:
    """One pool, ``tenants`` all backlogged, at least ``backlog`` requests outstanding."""
    from inference.catalog import pool_prefix
    from inference.gateway.admission import BANDS, W_IN, W_OUT, Admission
    from inference.gateway.admission.scripts import COMPLETE, ENQUEUE, TICK
    from inference.gateway.lua import Batch
    from inference.gateway.redis import redis_async

    admin = _admin(redis_url)
    admin.flushdb()
    base = pool_prefix(POOL)
    # As catalog_publish writes a pool: first with no ready replica (its "none" marker) while
    # the backlog is made, so that no tenant is admitted before all are waiting (the first
    # ones admitted into an empty pool would start with lower counters and catch up for a
    # while: not the steady state); then its replicas' capacity.
    admin.hset(base + "replicas", "none", 0)
    admin.set(base + "policy", "vtc")
    capacity = REPLICAS * SLOTS
    # Requests per tenant, all outstanding at all times: enough that every tenant always has
    # one queued (with 10 tenants each runs ~6 at a time), and that the pool's backlog holds
    # ``backlog`` (how long the head has waited decides whether a dispatch that finds no room
    # scans the next tenants for one that fits: only while it is younger than BACKFILL_MS).
    per_tenant = max(2, 2 * capacity // tenants + 2, -(-backlog // tenants))
    processes = [Admission(proc=f"scale-{i}") for i in range(PROCESSES)]
    owned: list[asyncio.Queue[str]] = [asyncio.Queue() for _ in processes]
    tenant_of: dict[str, int] = {}
    load = _Load()

    def enqueue_args(process: Admission, rid: str, tenant: int) -> list[str | int | float]:
        # admit()'s arguments: rid tenant weight est proc prefix wait_ms adapter seqs
        return process._args(
            rid, tenant, 1, W_IN * PROMPT, process.proc, _prefix_of(tenant), WAIT_MS, "", 1
        )

    # The backlog, pipelined (set-up, not measured): tenant after tenant, round after round.
    t_fill = time.perf_counter()
    order = [(t, i) for i in range(per_tenant) for t in range(1, tenants + 1)]
    for lo in range(0, len(order), 1000):
        batch = Batch()
        for n, (tenant, _) in enumerate(order[lo : lo + 1000], start=lo):
            rid = uuid.uuid4().hex
            tenant_of[rid] = tenant
            batch.script(ENQUEUE, [base], enqueue_args(processes[n % PROCESSES], rid, tenant))
        for result in await batch.execute():
            assert result[0] == b"queued"
    fill_s = time.perf_counter() - t_fill
    pipe = admin.pipeline(transaction=True)
    pipe.delete(base + "replicas")
    pipe.hset(base + "replicas", mapping={str(r): SLOTS for r in range(1, REPLICAS + 1)})
    pipe.execute()

    async def listen(p: int) -> None:
        """The process's grant listener: one BLPOP per grant, as Admission._listen."""
        client = redis_async()
        key = base + "grants:" + processes[p].proc
        while not load.stop:
            item = await client.blpop([key], timeout=0.1)
            if item is not None:
                owned[p].put_nowait(_text(item[1]).partition("|")[0])

    async def request_loop(p: int) -> None:
        """Take a granted request, complete it (COMPLETE admits the next waiting request),
        and send its tenant's next one (ENQUEUE: it queues behind the backlog)."""
        process = processes[p]
        while not load.stop:
            try:
                rid = await asyncio.wait_for(owned[p].get(), timeout=0.1)
            except TimeoutError:
                continue
            tenant = tenant_of.pop(rid)
            t0 = time.perf_counter()
            batch = Batch()  # the end of a request: COMPLETE in one Batch, as the pipeline
            process.complete_into(batch, pool=POOL, rid=rid, adjustment=W_OUT * COMPLETION)
            await batch.execute()
            t1 = time.perf_counter()
            new = uuid.uuid4().hex
            tenant_of[new] = tenant
            result = await ENQUEUE(keys=[base], args=enqueue_args(process, new, tenant))
            t2 = time.perf_counter()
            if result[0] == b"granted":
                owned[p].put_nowait(new)
            if load.on:
                load.complete.append(t1 - t0)
                load.enqueue.append(t2 - t1)
                load.granted_at_enqueue += result[0] == b"granted"

    tasks = [asyncio.create_task(listen(p)) for p in range(PROCESSES)]
    tasks += [asyncio.create_task(request_loop(p)) for p in range(PROCESSES) for _ in range(LOOPS)]
    # What a waiting process's listener does between grants: its dispatch admits the first
    # 64, whose grants go to their processes' lists.
    await TICK(keys=[base], args=processes[0]._args())
    servers = _servers(admin, base + "replicas")
    server = _Server(servers)
    try:
        await asyncio.sleep(1.0)  # warm: connections, scripts registered
        load.reset(on=True)
        server.begin()
        await asyncio.sleep(seconds)
        load.on = False
        admissions = len(load.complete)
        redis_side = server.end(script_calls=admissions + len(load.enqueue), events=admissions)
        enqueue, complete, direct = load.enqueue, load.complete, load.granted_at_enqueue
        wall = redis_side["wall_s"]
        wanted = {ENQUEUE.sha.encode(): "enqueue", COMPLETE.sha.encode(): "complete"}

        def ours(parts: list[bytes]) -> str | None:
            if len(parts) > 3 and parts[0].lower() == b"evalsha" and parts[3] == base.encode():
                return wanted.get(parts[1])
            return None

        sampled = await _slowlog(_url(servers[0]), seconds / 2, ours)
        # (a backlog per priority band since the bands: every request here is in one)
        backlogged = sum(int(admin.zcard(f"{base}backlog:{band}")) for band in range(BANDS))
        holds = int(admin.zcard(base + "holds"))
        running = sum(int(v) for v in admin.hvals(base + "rload"))
    finally:
        load.stop = True
        await asyncio.gather(*tasks, return_exceptions=True)
        admin.flushdb()
    by_script = {name: _dist(values) for name, values in sampled.items()}
    per_admission = sum(d.get("mean_us", 0.0) for d in by_script.values())
    return {
        "tenants": tenants,
        "requests_outstanding": tenants * per_tenant,
        # how long a request waits in the backlog, from Little's law: over BACKFILL_MS, a
        # dispatch that finds no room stops at once; under it, it scans BACKFILL_SCAN more
        "queue_wait_s": round((tenants * per_tenant - capacity) / max(admissions / wall, 1), 2),
        "fill_s": round(fill_s, 1),
        "admissions": admissions,
        "admissions_per_s": round(admissions / wall, 1),
        "client_enqueue_p50_us": _us(enqueue, 50),
        "client_enqueue_p99_us": _us(enqueue, 99),
        "client_complete_p50_us": _us(complete, 50),
        "client_complete_p99_us": _us(complete, 99),
        "granted_at_enqueue": direct,  # 0: every admission went through the backlog
        **redis_side,
        "slowlog": by_script,
        "slowlog_us_per_admission": round(per_admission, 2),
        # extrapolation: admissions/s one Redis core would give if it were the only limit
        "redis_bound_admissions_per_s": round(
            admissions / wall / max(redis_side["redis_cpu_fraction"], 1e-9)
        ),
        "end_backlogged_tenants": backlogged,
        "end_holds": holds,
        "end_sequences_running": running,
        # the pool was as set up from start to end (someone else flushing the database, or a
        # backlog that ran dry, would show here)
        "valid": backlogged == tenants and running == capacity and direct == 0,
    }


async def _limits_phase(tenants: int, redis_url: str, seconds: float) -> dict[str, Any]:
    from inference.gateway.auth import KeyInfo
    from inference.gateway.limits import ACQUIRE, RELEASE, _month, _scopes, _seconds_to_next_month
    from inference.gateway.limits import acquire as limits_acquire
    from inference.gateway.lua import Batch
    from tenants.keys import last_used_key

    admin = _admin(redis_url)
    admin.flushdb()
    month = _month()
    # Per tenant one key. Tenant: rpm, tpm, concurrency and a monthly token budget; key: rpm.
    keys = [
        KeyInfo(
            key_id=LIMIT_TENANT0 + t,
            prefix=f"{LIMIT_TENANT0 + t:012x}",
            digest="",
            tenant_id=LIMIT_TENANT0 + t,
            tenant_slug=f"scale-{t}",
            weight=1,
            scopes=frozenset({"inference"}),
            expires_at=None,
            tenant_limits=(100_000, 100_000_000, 1000, 0, 10**12, 0),
            key_limits=(100_000, 0, 0, 0, 0, 0),
        )
        for t in range(tenants)
    ]
    # The monthly counters, as acquire() seeds them from the ledger (none here: zero).
    pipe = admin.pipeline(transaction=False)
    for key in keys:
        pipe.set(_scopes(key, month)[0]["month"], 0, nx=True, ex=_seconds_to_next_month())
    pipe.execute()
    acquire_s: list[float] = []
    release_s: list[float] = []
    state = {"on": False, "stop": False}

    async def cycle(key: KeyInfo) -> None:
        t0 = time.perf_counter()
        grant = await limits_acquire(key, rid=uuid.uuid4().hex, estimate=700, estimated_cost=900)
        t1 = time.perf_counter()
        batch = Batch()  # released with the rest of the request's end, as the pipeline does
        grant.release_into(batch, 650, 850)
        await batch.execute()
        if state["on"]:
            acquire_s.append(t1 - t0)
            release_s.append(time.perf_counter() - t1)

    async def fill(start: int) -> None:
        for key in keys[start :: 4 * PROCESSES]:
            await cycle(key)

    t_fill = time.perf_counter()  # every tenant's limit state in Redis, as after a busy minute
    await asyncio.gather(*(fill(i) for i in range(4 * PROCESSES)))
    fill_s = time.perf_counter() - t_fill

    async def worker() -> None:
        rng = random.Random()
        while not state["stop"]:
            await cycle(keys[rng.randrange(tenants)])

    tasks = [asyncio.create_task(worker()) for _ in range(PROCESSES * LOOPS)]
    servers = _servers(admin)
    server = _Server(servers)
    try:
        await asyncio.sleep(0.5)
        acquire_s.clear()
        release_s.clear()
        state["on"] = True
        server.begin()
        await asyncio.sleep(seconds)
        state["on"] = False
        cycles = len(release_s)
        redis_side = server.end(script_calls=2 * cycles, events=cycles)
        acq, rel = list(acquire_s), list(release_s)
        wanted = {ACQUIRE.sha.encode(): "acquire", RELEASE.sha.encode(): "release"}
        mine = b"ip:rl:{t:" + str(LIMIT_TENANT0)[:3].encode()

        def ours(parts: list[bytes]) -> str | None:
            if len(parts) > 3 and parts[0].lower() == b"evalsha" and parts[3].startswith(mine):
                return wanted.get(parts[1])
            return None

        sampled = await _slowlog(_url(servers[0]), seconds / 2, ours)
        dbsize = int(admin.dbsize())
        counting = admin.pipeline(transaction=False)  # every key's last use: a hash per tenant
        for key in keys:
            counting.hlen(last_used_key(key.tenant_id))
        stamped = sum(int(n) for n in counting.execute())
    finally:
        state["stop"] = True
        await asyncio.gather(*tasks, return_exceptions=True)
        admin.flushdb()
    wall = redis_side["wall_s"]
    return {
        "tenants": tenants,
        "fill_s": round(fill_s, 1),
        "redis_keys": dbsize,
        "last_used_hash_fields": stamped,
        "valid": stamped == tenants,
        "cycles": cycles,
        "cycles_per_s": round(cycles / wall, 1),
        "client_acquire_p50_us": _us(acq, 50),
        "client_acquire_p99_us": _us(acq, 99),
        "client_release_p50_us": _us(rel, 50),
        "client_release_p99_us": _us(rel, 99),
        **redis_side,
        "slowlog": {name: _dist(values) for name, values in sampled.items()},
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def admission(quick: bool, redis_url: str, cluster_url: str | None = None) -> dict[str, Any]:
    """The admission and limits scripts at growing tenant counts (see the module's doc);
    with ``cluster_url``, also one pool and the limits on a Redis Cluster (``on_cluster``)."""
    _django(redis_url)
    counts = [10, 1_000, 10_000] if quick else [10, 1_000, 100_000]
    limit_counts = [1_000, 10_000] if quick else [1_000, 100_000]
    seconds = 2.0 if quick else 4.0
    # Outstanding requests in the deep phases: their heads wait well over BACKFILL_MS at any
    # rate this machine reaches, at every tenant count (so all run the same script path).
    deep = 10_000 if quick else 20_000

    async def run() -> dict[str, Any]:
        # 10 tenants first and again last: the baseline, and the machine's drift over the run
        order = [*counts, counts[0]]
        phases = [await _admission_phase(n, redis_url, seconds, deep) for n in order]
        # 10 tenants, the backlog shallow (heads younger than BACKFILL_MS): the other path
        shallow = await _admission_phase(counts[0], redis_url, seconds, 0)
        limits = [await _limits_phase(n, redis_url, seconds) for n in limit_counts]
        return {"admission": phases, "shallow": shallow, "limits": limits}

    out = asyncio.run(run())
    clustered = on_cluster(quick, redis_url, cluster_url) if cluster_url else None
    phases, limits = out["admission"], out["limits"]
    base, again, high = phases[0], phases[-1], phases[-2]

    def ratio(figure: str) -> float:
        """The largest tenant count's figure over 10 tenants' (the mean of both runs)."""
        return _ratio(high[figure], (base[figure] + again[figure]) / 2)

    lim_low, lim_high = limits[0], limits[-1]
    return {
        "quick": quick,
        "tenant_counts": counts,
        "limits_tenant_counts": limit_counts,
        "pool_sequences": REPLICAS * SLOTS,
        "simulated_processes": PROCESSES,
        "concurrent_requests": PROCESSES * LOOPS,
        "deep_backlog_requests": deep,
        "all_valid": all(p["valid"] for p in [*phases, out["shallow"], *limits]),
        "admission": phases,
        "admission_shallow_backlog": out["shallow"],
        "limits": limits,
        # largest tenant count / 10 tenants (same run, deep backlog); ~1 = flat
        "ratio_script_us_per_admission": ratio("script_us_per_event"),
        "ratio_slowlog_us_per_admission": ratio("slowlog_us_per_admission"),
        "ratio_redis_cpu_per_admission": ratio("redis_cpu_us_per_event"),
        "ratio_admissions_per_s": ratio("admissions_per_s"),
        # the two 10-tenant runs, second / first: how far the machine drifted meanwhile
        "baseline_drift": _ratio(again["script_us_per_event"], base["script_us_per_event"]),
        # 10 tenants, shallow backlog (the backfill scan runs) / deep backlog (it does not)
        "ratio_shallow_vs_deep_script_us_per_admission": _ratio(
            out["shallow"]["script_us_per_event"],
            (base["script_us_per_event"] + again["script_us_per_event"]) / 2,
        ),
        # limits: largest tenant count / 1,000 tenants
        "limits_ratio_script_us_per_cycle": _ratio(
            lim_high["script_us_per_event"], lim_low["script_us_per_event"]
        ),
        "limits_ratio_slowlog_acquire_mean": _ratio(
            lim_high["slowlog"].get("acquire", {}).get("mean_us", 0.0),
            lim_low["slowlog"].get("acquire", {}).get("mean_us", 0.0),
        ),
        "limits_ratio_cycles_per_s": _ratio(lim_high["cycles_per_s"], lim_low["cycles_per_s"]),
        "limits_ratio_client_acquire_p99": _ratio(
            lim_high["client_acquire_p99_us"], lim_low["client_acquire_p99_us"]
        ),
        **({"cluster": clustered} if clustered else {}),
    }


def on_cluster(quick: bool, redis_url: str, cluster_url: str) -> dict[str, Any]:
    """What a Redis Cluster's shard does against one Redis, back to back in the same run:
    one pool's admission (1,000 tenants, deep backlog: its keys are one slot, so one master
    serves it) and the limits (10,000 tenants: their slots spread over every master). Redis
    CPU per admission or per request on the shard(s), cluster over plain: what running on a
    cluster costs per operation; the script calls' spread over the masters."""
    tenants, limit_tenants = 1_000, 10_000
    seconds = 2.0 if quick else 4.0
    deep = 10_000 if quick else 20_000

    from inference.gateway.redis import state_use

    def on(url: str, phase: Any, *args: Any) -> dict[str, Any]:
        state_use(url)
        try:
            result: dict[str, Any] = asyncio.run(phase(*args))
        finally:
            state_use(redis_url)
        return result

    plain = on(redis_url, _admission_phase, tenants, redis_url, seconds, deep)
    shard = on(cluster_url, _admission_phase, tenants, cluster_url, seconds, deep)
    plain_limits = on(redis_url, _limits_phase, limit_tenants, redis_url, seconds)
    shard_limits = on(cluster_url, _limits_phase, limit_tenants, cluster_url, seconds)
    return {
        "admission_one_redis": plain,
        "admission_cluster_shard": shard,
        "limits_one_redis": plain_limits,
        "limits_cluster": shard_limits,
        "all_valid": all(p["valid"] for p in (plain, shard, plain_limits, shard_limits)),
        # cluster / one Redis, the same work: Redis CPU and script time per operation
        "ratio_admission_redis_cpu_per_admission": _ratio(
            shard["redis_cpu_us_per_event"], plain["redis_cpu_us_per_event"]
        ),
        "ratio_admission_script_us_per_admission": _ratio(
            shard["script_us_per_event"], plain["script_us_per_event"]
        ),
        "ratio_limits_redis_cpu_per_request": _ratio(
            shard_limits["redis_cpu_us_per_event"], plain_limits["redis_cpu_us_per_event"]
        ),
        "ratio_limits_script_us_per_request": _ratio(
            shard_limits["script_us_per_event"], plain_limits["script_us_per_event"]
        ),
    }


# --- keys ----------------------------------------------------------------------------------

KEYS_PER_TENANT = 10
SCALE_LIMITS = (600, 200_000, 20, 0, 0, 0)  # the tenants' rpm, tpm, concurrency


def _full_key(g: int) -> str:
    return f"sk-ip-{g:012x}_s{g}"


def _populate(keys: int) -> dict[str, Any]:
    """``keys`` ApiKey rows (and a tenant per 10), made by one server-side INSERT each,
    unless the database holds exactly them already."""
    from django.db import connection

    from tenants.models import ApiKey

    tenants = keys // KEYS_PER_TENANT
    t0 = time.perf_counter()
    built = False
    if ApiKey.objects.count() != keys or not ApiKey.objects.filter(prefix=f"{keys:012x}").exists():
        built = True
        with connection.cursor() as cur:
            cur.execute("TRUNCATE tenants_apikey, tenants_tenant RESTART IDENTITY CASCADE")
            cur.execute(
                """
                INSERT INTO tenants_tenant (slug, name, status, weight, created_at, updated_at,
                                            rpm, tpm, max_concurrency)
                SELECT 'scale-' || g, 'Scale tenant ' || g, 'active', 1, now(), now(),
                       %(rpm)s, %(tpm)s, %(conc)s
                FROM generate_series(1, %(tenants)s) AS g
                """,
                {
                    "tenants": tenants,
                    "rpm": SCALE_LIMITS[0],
                    "tpm": SCALE_LIMITS[1],
                    "conc": SCALE_LIMITS[2],
                },
            )
            cur.execute(
                """
                INSERT INTO tenants_apikey (tenant_id, name, prefix, secret_hash, scopes,
                                            created_at)
                SELECT 1 + g %% %(tenants)s, 'scale', lpad(to_hex(g), 12, '0'),
                       encode(sha256(convert_to(
                         'sk-ip-' || lpad(to_hex(g), 12, '0') || '_s' || g, 'UTF8')), 'hex'),
                       '["inference"]'::jsonb, now()
                FROM generate_series(1, %(keys)s) AS g
                """,
                {"tenants": tenants, "keys": keys},
            )
            cur.execute("VACUUM ANALYZE tenants_apikey")
            cur.execute("VACUUM ANALYZE tenants_tenant")
    with connection.cursor() as cur:
        cur.execute("SELECT pg_total_relation_size('tenants_apikey')")
        row = cur.fetchone()
        assert row is not None
    return {"built": built, "build_s": round(time.perf_counter() - t0, 1), "pg_bytes": row[0]}


def _info_of(g: int, tenants: int) -> KeyInfo:
    """Key ``g`` as ``key_info_from_db`` makes it (checked against the database below)."""
    from inference.gateway.auth import KeyInfo

    tenant = 1 + g % tenants
    return KeyInfo(
        key_id=g,
        prefix=f"{g:012x}",
        digest=hashlib.sha256(_full_key(g).encode()).hexdigest(),
        tenant_id=tenant,
        tenant_slug=f"scale-{tenant}",
        weight=1,
        scopes=frozenset({"inference"}),
        expires_at=None,
        tenant_limits=SCALE_LIMITS,
        key_limits=(0, 0, 0, 0, 0, 0),
    )


def _used_memory(client: redis.Redis) -> int:
    info: dict[str, Any] = client.info("memory")
    return int(info["used_memory"])


async def _keys_measure(keys: int, redis_url: str, quick: bool) -> dict[str, Any]:
    from inference.gateway import auth
    from inference.gateway.db import run_db
    from inference.keycache import ENTRY_SECONDS, KEY_ENTRY, TENANT_KEYS

    tenants = keys // KEYS_PER_TENANT
    admin = redis.Redis.from_url(redis_url)
    admin.flushdb()
    rng = random.Random(7)
    out: dict[str, Any] = {}

    async def timed(sample: list[int], *, cold_process: bool) -> tuple[list[float], float]:
        """Per-call wall times of authenticate(), one call at a time; CPU per call (this
        process, executor threads included)."""
        times: list[float] = []
        cpu0 = time.process_time()
        for g in sample:
            if cold_process:
                auth._l1.clear()
            t = time.perf_counter()
            info = await auth.authenticate(_full_key(g))
            times.append(time.perf_counter() - t)
            assert info.prefix == f"{g:012x}"
        return times, (time.process_time() - cpu0) / len(sample)

    # The loader's output for one key equals what this bench writes for a million.
    probe = rng.randrange(1, keys + 1)
    from_db = await run_db(auth.key_info_from_db, f"{probe:012x}")
    out["entry_matches_loader"] = from_db == _info_of(probe, tenants)
    out["entry_bytes_json"] = len(_info_of(probe, tenants).to_json())

    # 1. The Postgres path: Redis and process cold, a key among all the rows.
    samples = 300 if quick else 500
    await timed([rng.randrange(1, keys + 1) for _ in range(20)], cold_process=True)  # connect
    pg, pg_cpu = await timed(rng.sample(range(1, keys + 1), samples), cold_process=True)
    admin.flushdb()

    # 2. Redis memory for every key cached, written as auth._load writes an entry (SET NX EX
    # of its JSON), then the tenants' sets of cached prefixes (the loader SADDs one prefix at
    # a time; here a tenant's ten at once: the same set), measured apart.
    gc.collect()
    mem0 = _used_memory(admin)
    t_write = time.perf_counter()
    for lo in range(1, keys + 1, 20_000):
        pipe = admin.pipeline(transaction=False)
        for g in range(lo, min(keys + 1, lo + 20_000)):
            entry = _info_of(g, tenants).to_json()
            pipe.set(KEY_ENTRY.format(prefix=f"{g:012x}"), entry, ex=ENTRY_SECONDS, nx=True)
        pipe.execute()
    mem_entries = _used_memory(admin)
    for lo in range(0, tenants, 10_000):
        pipe = admin.pipeline(transaction=False)
        for tenant in range(1 + lo, 1 + min(tenants, lo + 10_000)):
            # the keys g with 1 + g % tenants == tenant
            members = [f"{g:012x}" for g in range(tenant - 1 or tenants, keys + 1, tenants)]
            pipe.sadd(TENANT_KEYS.format(tenant_id=tenant), *members)
        pipe.execute()
    mem_all = _used_memory(admin)
    write_s = time.perf_counter() - t_write
    one = admin.memory_usage(KEY_ENTRY.format(prefix=f"{probe:012x}"))
    one_set = admin.memory_usage(TENANT_KEYS.format(tenant_id=1 + probe % tenants))

    # 3. The Redis hit: process cache cold, every key in Redis.
    rd, rd_cpu = await timed(rng.sample(range(1, keys + 1), 2000), cold_process=True)

    # 4. The in-process hit: one key, looked up again and again within its second.
    hot = rng.randrange(1, keys + 1)
    await auth.authenticate(_full_key(hot))
    full = _full_key(hot)
    calls = 50_000
    cpu0, t = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await auth.authenticate(full)
    l1_us = (time.perf_counter() - t) * 1e6 / calls
    l1_cpu_us = (time.process_time() - cpu0) * 1e6 / calls

    # 5. The process's memory per cached key: 10,000 distinct keys through authenticate().
    distinct = 10_000
    auth._l1.clear()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for g in rng.sample(range(1, keys + 1), distinct):
        await auth.authenticate(_full_key(g))
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    cached = len(auth._l1)
    auth._l1.clear()
    per_entry = (after - before) / cached
    admin.flushdb()

    redis_hit_us = statistics.fmean(rd) * 1e6
    pg_us = statistics.fmean(pg) * 1e6
    out.update(
        {
            "l1_hit_us": round(l1_us, 2),
            "l1_hit_cpu_us": round(l1_cpu_us, 2),
            "redis_hit_p50_us": _us(rd, 50),
            "redis_hit_p99_us": _us(rd, 99),
            "redis_hit_mean_us": round(redis_hit_us, 1),
            "redis_hit_cpu_us": round(rd_cpu * 1e6, 1),
            "postgres_p50_us": _us(pg, 50),
            "postgres_p99_us": _us(pg, 99),
            "postgres_mean_us": round(pg_us, 1),
            "postgres_cpu_us": round(pg_cpu * 1e6, 1),
            "postgres_samples": samples,
            # baselines: the next level down, and the gateway's own CPU per request
            "redis_hit_vs_l1": _ratio(redis_hit_us, l1_us),
            "postgres_vs_redis_hit": _ratio(pg_us, redis_hit_us),
            "gateway_cpu_per_request_us_ref": GATEWAY_CPU_MS * 1000,
            "l1_hit_share_of_gateway_cpu": round(l1_cpu_us / (GATEWAY_CPU_MS * 1000), 5),
            "redis_hit_cpu_share_of_gateway_cpu": round(rd_cpu * 1e6 / (GATEWAY_CPU_MS * 1000), 4),
            "redis_write_s": round(write_s, 1),
            "redis_bytes_per_key_entry": round((mem_entries - mem0) / keys, 1),
            "redis_bytes_per_key_tenant_index": round((mem_all - mem_entries) / keys, 1),
            "redis_bytes_per_key": round((mem_all - mem0) / keys, 1),
            "redis_total_mb": round((mem_all - mem0) / 2**20, 1),
            "redis_memory_usage_one_entry": one,
            "redis_memory_usage_one_tenant_set": one_set,
            "process_bytes_per_cached_key": round(per_entry, 1),
            "process_keys_cached": cached,
            "process_cache_cap_entries": auth.L1_MAX_ENTRIES,
            "process_cache_cap_mb": round(per_entry * auth.L1_MAX_ENTRIES / 2**20, 1),
        }
    )
    return out


def keys(quick: bool, database_url: str, redis_url: str) -> dict[str, Any]:
    """Key authentication over a million keys (see the module's doc)."""
    import psycopg

    n = 100_000 if quick else 1_000_000
    dbname = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [dbname]).fetchone():
            conn.execute(f'CREATE DATABASE "{dbname}"')
    _django(redis_url, database_url)
    from django.core.management import call_command

    t = time.perf_counter()
    call_command("migrate", verbosity=0)
    migrate_s = time.perf_counter() - t
    built = _populate(n)
    measured = asyncio.run(_keys_measure(n, redis_url, quick))
    from tenants.models import ApiKey

    # the rows were there all along (another run sharing the database may empty them)
    measured["valid"] = ApiKey.objects.count() == n and measured["entry_matches_loader"]
    return {
        "quick": quick,
        "keys": n,
        "tenants": n // KEYS_PER_TENANT,
        "migrate_s": round(migrate_s, 1),
        "db_built": built["built"],
        "db_build_s": built["build_s"],
        "postgres_apikey_bytes_per_key": round(built["pg_bytes"] / n, 1),
        "postgres_apikey_total_mb": round(built["pg_bytes"] / 2**20, 1),
        **measured,
    }


if __name__ == "__main__":
    redis_url = os.environ.get("BENCH_SCALE_REDIS_URL", "redis://127.0.0.1:6379/13")
    database_url = os.environ.get(
        "BENCH_SCALE_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/inferplane_scale"
    )
    _django(redis_url, database_url)
    print(json.dumps(admission(True, redis_url), indent=2))
    print(json.dumps(keys(True, database_url, redis_url), indent=2))
