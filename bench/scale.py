"""How far one deployment's shared parts go, measured by simulation on this machine.

Each figure against a baseline measured in the same run (the machines are shared and noisy):

  admission   the gateway's own Lua scripts (VTC admission, per-tenant limits) driven at full
              speed by many simulated web processes against one Redis, with 10, 1,000 and
              100,000 backlogged tenants: admissions per second and script time, against the
              10-tenant figure (``bench/scale_admission.py``).
  catalog     a catalog of 10,000 tenants and 50,000 adapter versions: its bytes, what keeping
              it fresh costs a web process per second under each design (re-read every second,
              the version polled four times a second, told by a subscription), and a real web
              process (``scripts/web.sh``) idle with it: CPU per second, Redis commands, and how
              soon a change reaches it.
  keys        key authentication with 1,000,000 keys: the in-process and Redis hit paths per
              request, and memory (``bench/scale_admission.py``).
  ledger      records per second from the spool into Postgres, through the real flusher
              (``usage_spool_flush``), against the ORM's ``bulk_create`` it replaced; two
              flushers racing (every record exactly once); and one month's invoice of the
              heaviest tenant against the ledger's size.

Its own Postgres database (``inferplane_scale``) and Redis database (13)::

    .venv/bin/python -m bench.scale            # the figures of bench/RESULTS.md (~20 min)
    .venv/bin/python -m bench.scale --quick    # the same, smaller (under five minutes)
    .venv/bin/python -m bench.scale --only catalog,ledger
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import httpx

from bench.harness import ROOT, _spawn, _stop, _wait_http, free_port
from devkit.redis_cluster import cluster_start, cluster_stop

DB_URL = os.environ.get(
    "BENCH_SCALE_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/inferplane_scale"
)
REDIS_URL = os.environ.get("BENCH_SCALE_REDIS_URL", "redis://127.0.0.1:6379/13")
MONTH = date(2026, 10, 1)


def setup() -> None:
    os.environ["DATABASE_URL"] = DB_URL
    os.environ["REDIS_URL"] = REDIS_URL
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import psycopg

    dbname = DB_URL.rsplit("/", 1)[1]
    with psycopg.connect(DB_URL.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [dbname]).fetchone():
            conn.execute(f'CREATE DATABASE "{dbname}"')
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) a process and its children have used, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids = [pid]
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != pid:
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        pids.append(int(entry))
            except OSError:
                continue
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return total


def _cpu_per_call(fn: Callable[[], Any], *, runs: int) -> float:
    """CPU seconds of this process per call of ``fn`` (best of three rounds)."""
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(runs):
            fn()
        best = min(best, (time.process_time() - start) / runs)
    return best


# --- the catalog ---------------------------------------------------------------------------


def _big_catalog(tenants: int, adapters: int, versions: int) -> Any:
    from contract import (
        AdapterVersion,
        Catalog,
        CatalogAdapter,
        CatalogModel,
        CatalogPool,
        CatalogReplica,
        PriceRow,
    )

    models = {}
    pools = {}
    for m in range(4):
        name = f"model-{m}"
        d = Decimal
        prices = {"list": [PriceRow(0.0, d(1), d("0.5"), d(2), d(50))]} | {
            f"tenant:{t}": [PriceRow(0.0, d("0.8"), d("0.4"), d("1.6"), d(50))]
            for t in range(1, tenants // 10)
        }
        models[name] = CatalogModel(
            served_name=f"/models/{name}",
            context_length=8192,
            supports_lora=True,
            is_public=True,
            allowed_tenants=frozenset(),
            created=1_700_000_000,
            online_pool=f"online-{m}",
            batch_pool=f"spot-{m}",
            prices=prices,
        )
        for kind in ("online", "spot"):
            pools[f"{kind}-{m}"] = CatalogPool(
                kind="dedicated" if kind == "online" else "spot",
                model=name,
                policy="vtc",
                max_inflight=64,
                max_queue_wait_seconds=30,
                max_loras=8,
                replicas={
                    str(m * 100 + r): CatalogReplica(
                        url=f"http://10.0.{m}.{r}:8000", state="ready", name=f"{kind}-{m}-{r}"
                    )
                    for r in range(16)
                },
            )
    found = {}
    for a in range(adapters):
        tenant = 1 + a % tenants
        address = f"tenant-{tenant:05d}/adapter-{a:06d}"
        model = f"model-{a % 4}"
        found[address] = CatalogAdapter(
            tenant=tenant,
            created=1_700_000_000 + a,
            latest=versions,
            versions={
                str(v): AdapterVersion(
                    engine_name=f"{address}:{v}",
                    path=f"/var/lib/inferplane/adapters/{a:064x}"[:90],
                    model=model,
                )
                for v in range(1, versions + 1)
            },
        )
    return Catalog(version=time.time_ns(), models=models, pools=pools, adapters=found)


def _gateway_connections(redis: Any, pid: int) -> list[dict[str, Any]]:
    """The Redis connections of one web process (named by ``inference.gateway.redis``)."""
    return [c for c in redis.client_list() if str(c.get("name", "")).endswith(f"-{pid}")]


def _publish_big(redis: Any, catalog: Any) -> None:
    """Write a catalog into Redis as ``catalog_publish`` does: the snapshot without the
    adapters, each tenant's adapters a part of their own."""
    import msgspec

    from contract import encode
    from inference.catalog import (
        ADAPTERS_KEY,
        ADAPTERS_SERIAL_KEY,
        CATALOG_KEY,
        CATALOG_VERSION_KEY,
        _adapter_parts,
    )

    parts = _adapter_parts(catalog)
    pipe = redis.pipeline(transaction=False)
    items = list(parts.items())
    for lo in range(0, len(items), 1000):
        pipe.hset(ADAPTERS_KEY, mapping=dict(items[lo : lo + 1000]))
    pipe.set(CATALOG_KEY, encode(msgspec.structs.replace(catalog, adapters={})))
    pipe.set(CATALOG_VERSION_KEY, 1)
    pipe.set(ADAPTERS_SERIAL_KEY, 1)
    pipe.execute()


def catalog(quick: bool) -> dict[str, Any]:
    """Bytes and CPU of the catalog at 10,000 tenants and 50,000 adapter versions, by design;
    then a real web process idle with it, and a change of each kind reaching it."""
    import msgspec

    from contract import AdapterVersion, CatalogAdapter, catalog_decoder, encode
    from controlplane.redis import channel, redis_sync
    from inference.catalog import (
        ADAPTERS_KEY,
        ADAPTERS_SERIAL_KEY,
        CATALOG_CHANNEL,
        CATALOG_KEY,
        CATALOG_VERSION_KEY,
        _adapter_parts,
        adapters_part_decoder,
    )
    from tenants.services import api_key_create, tenant_create

    tenants, adapters, versions = 10_000, 25_000, 2
    big = _big_catalog(tenants, adapters, versions)
    whole = encode(big)
    parts = _adapter_parts(big)
    redis = redis_sync()
    redis.flushdb()
    redis.set("bench:whole", whole)
    _publish_big(redis, big)
    snapshot = cast(bytes, redis.get(CATALOG_KEY))
    out: dict[str, Any] = {
        "tenants": tenants,
        "adapter_versions": adapters * versions,
        "whole_bytes": len(whole),
        "snapshot_bytes": len(snapshot),
        "part_bytes_mean": sum(map(len, parts.values())) / len(parts),
    }
    # What keeping it fresh costs one process (its own CPU), by design.
    fetch_whole = _cpu_per_call(
        lambda: catalog_decoder.decode(cast(bytes, redis.get("bench:whole"))), runs=3
    )
    fetch_snapshot = _cpu_per_call(
        lambda: catalog_decoder.decode(cast(bytes, redis.get(CATALOG_KEY))), runs=50
    )
    fetch_part = _cpu_per_call(
        lambda: adapters_part_decoder.decode(cast(bytes, redis.hget(ADAPTERS_KEY, "77"))),
        runs=2000,
    )
    version = _cpu_per_call(lambda: redis.get(CATALOG_VERSION_KEY), runs=2000)
    out["fetch_whole_cpu_ms"] = fetch_whole * 1000
    out["fetch_snapshot_cpu_ms"] = fetch_snapshot * 1000
    out["fetch_one_tenant_part_cpu_ms"] = fetch_part * 1000
    out["design_reread_whole_every_second_cpu_ms_per_s"] = fetch_whole * 1000
    out["design_version_poll_4_per_s_cpu_ms_per_s"] = version * 4 * 1000
    # A real web process, idle: before it has read the catalog (the baseline: uvicorn's own
    # idling), then with the catalog and one tenant's part loaded.
    slug = f"scale-{time.time_ns()}"
    tenant = tenant_create(slug=slug, weight=1, limits={}, actor=None)
    key = api_key_create(tenant=tenant, name="bench", created_by=None).secret
    port = free_port()
    env = {"DATABASE_URL": DB_URL, "REDIS_URL": REDIS_URL, "WEB_CONCURRENCY": "1"}
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    web = _spawn(
        f"scale-web-{port}",
        [str(ROOT / "scripts" / "web.sh"), "--port", str(port), "--no-access-log"],
        {**env, "PATH": path},
    )
    url = f"http://127.0.0.1:{port}"
    headers = {"authorization": f"Bearer {key}"}
    idle_seconds = 10.0 if quick else 30.0

    def idle_cpu() -> float:
        cpu0, t0 = _cpu(web.pid), time.monotonic()
        time.sleep(idle_seconds)
        return (_cpu(web.pid) - cpu0) / (time.monotonic() - t0) * 1000

    def listed() -> set[str]:
        answer = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        return {m["id"] for m in answer.json()["data"]}

    def seen_after(name: str) -> float | None:
        published = time.monotonic()
        while time.monotonic() - published < 10:
            if name in listed():
                return (time.monotonic() - published) * 1000
            time.sleep(0.005)
        return None

    try:
        _wait_http(f"{url}/healthz", 60, web, f"scale-web-{port}")
        time.sleep(2)
        out["idle_web_cpu_ms_per_s_without_catalog"] = idle_cpu()
        listed()  # loads the snapshot and this tenant's part, subscribes
        time.sleep(2)
        out["idle_web_cpu_ms_per_s_with_catalog"] = idle_cpu()
        connections = _gateway_connections(redis, web.pid)  # web.sh execs uvicorn
        out["idle_redis_connections"] = len(connections)
        out["idle_redis_quiet_s_min"] = min((int(c["idle"]) for c in connections), default=-1)
        # A change of the snapshot: one more model.
        changed = msgspec.structs.replace(
            big,
            adapters={},
            version=time.time_ns(),
            models=big.models
            | {"scale-new": msgspec.structs.replace(big.models["model-0"], created=1)},
        )
        cpu = _cpu(web.pid)
        redis.set(CATALOG_KEY, encode(changed))
        redis.spublish(channel(CATALOG_CHANNEL), redis.incr(CATALOG_VERSION_KEY))
        out["snapshot_change_seen_after_ms"] = seen_after("scale-new")
        time.sleep(1)
        out["snapshot_change_web_cpu_ms"] = (_cpu(web.pid) - cpu) * 1000
        # A change of one tenant's adapters (an upload): only that part moves.
        address = f"{slug}/fresh"
        part = {
            address: CatalogAdapter(
                tenant=tenant.pk,
                created=1,
                latest=1,
                versions={"1": AdapterVersion(f"{address}:1", "/adapters/x", "model-0")},
            )
        }
        cpu = _cpu(web.pid)
        redis.hset(ADAPTERS_KEY, str(tenant.pk), encode(part))
        serial = redis.incr(ADAPTERS_SERIAL_KEY)
        redis.spublish(channel(CATALOG_CHANNEL), f"a:{serial}:{tenant.pk}")
        out["adapter_change_seen_after_ms"] = seen_after(address)
        time.sleep(1)
        out["adapter_change_web_cpu_ms"] = (_cpu(web.pid) - cpu) * 1000
    finally:
        _stop(web)
        redis.flushdb()
    return out


# --- the ledger ----------------------------------------------------------------------------


def _orm_insert(records: Any) -> int:
    """The ledger's insert before this benchmark: model instances through ``bulk_create``
    (500 rows a statement), 2,000 records a batch, on the schema of migration billing 0006
    (``_BEFORE``). Kept here as the baseline."""
    import msgspec
    from django.db import transaction

    from billing.models import UsageRecord
    from billing.pricing import PriceBook
    from tenants.models import ApiKey, Tenant

    rows = [UsageRecord(**msgspec.structs.asdict(r)) for r in records]
    tenants = set(
        Tenant.objects.filter(pk__in={r.tenant_id for r in rows}).values_list("pk", flat=True)
    )
    keys = set(
        ApiKey.objects.filter(pk__in={r.api_key_id for r in rows if r.api_key_id}).values_list(
            "pk", flat=True
        )
    )
    valid = [
        r for r in rows if r.tenant_id in tenants and (r.api_key_id is None or r.api_key_id in keys)
    ]
    book = PriceBook.for_models(r.model for r in valid)
    for row in valid:
        if row.cost_micros is None:
            row.cost_micros = book.cost_micros(row)
    with transaction.atomic():
        UsageRecord.objects.bulk_create(valid, ignore_conflicts=True, batch_size=500)
    return len(valid)


# What the ledger's writes paid before migration billing 0007: two deferred foreign-key
# checks per row at commit, and three more indexes. Put back for the baseline's runs.
_BEFORE = [
    (
        "ALTER TABLE billing_usagerecord ADD CONSTRAINT bench_fk_tenant FOREIGN KEY (tenant_id) "
        "REFERENCES tenants_tenant (id) DEFERRABLE INITIALLY DEFERRED",
        "ALTER TABLE billing_usagerecord DROP CONSTRAINT IF EXISTS bench_fk_tenant",
    ),
    (
        "ALTER TABLE billing_usagerecord ADD CONSTRAINT bench_fk_key FOREIGN KEY (api_key_id) "
        "REFERENCES tenants_apikey (id) DEFERRABLE INITIALLY DEFERRED",
        "ALTER TABLE billing_usagerecord DROP CONSTRAINT IF EXISTS bench_fk_key",
    ),
    (
        "CREATE INDEX bench_tenant ON billing_usagerecord (tenant_id)",
        "DROP INDEX IF EXISTS bench_tenant",
    ),
    (
        "CREATE INDEX bench_key ON billing_usagerecord (api_key_id)",
        "DROP INDEX IF EXISTS bench_key",
    ),
    (
        "CREATE INDEX bench_like ON billing_usagerecord (request_id varchar_pattern_ops)",
        "DROP INDEX IF EXISTS bench_like",
    ),
]


def _schema_before(on: bool) -> None:
    from django.db import connection

    with connection.cursor() as cur:
        for add, drop in _BEFORE:
            cur.execute(drop)  # what an interrupted run left, too
            if on:
                cur.execute(add)


def _ledger_world(tenants: int) -> tuple[list[int], list[int]]:
    from decimal import Decimal

    from django.db import connection

    from billing.models import Price
    from fleet.models import Model
    from tenants.models import ApiKey, Tenant

    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE billing_usagerecord, billing_dailyusage, billing_invoiceline, "
            "billing_invoice, tenants_apikey, tenants_tenant CASCADE"
        )
    Tenant.objects.bulk_create(
        [Tenant(slug=f"l{i:05d}", name=f"Tenant {i}") for i in range(tenants)]
    )
    tenant_ids = sorted(Tenant.objects.values_list("pk", flat=True))
    ApiKey.objects.bulk_create(
        [
            ApiKey(tenant_id=t, name="k", prefix=f"{t:012x}", secret_hash=f"{t:064x}")
            for t in tenant_ids
        ]
    )
    key_ids = [dict(ApiKey.objects.values_list("tenant_id", "pk"))[t] for t in tenant_ids]
    model, _ = Model.objects.get_or_create(
        name="scale-model", defaults={"served_name": "/m", "context_length": 4096}
    )
    Price.objects.get_or_create(
        model=model,
        tenant=None,
        effective_from=datetime(2020, 1, 1, tzinfo=UTC),
        defaults={
            "input_per_mtok": Decimal("0.15"),
            "cached_input_per_mtok": Decimal("0.075"),
            "output_per_mtok": Decimal("0.6"),
        },
    )
    return tenant_ids, key_ids


def _records(n: int, tenant_ids: list[int], key_ids: list[int], tag: str) -> list[Any]:
    from contract import UsageRecord

    start = datetime(2026, 10, 5, tzinfo=UTC)
    out = []
    for i in range(n):
        t = i % len(tenant_ids)
        at = start + timedelta(milliseconds=i * 7)
        out.append(
            UsageRecord(
                request_id=f"{tag}-{i:09d}",
                tenant_id=tenant_ids[t],
                api_key_id=key_ids[t],
                model="scale-model",
                endpoint="chat.completions",
                status="ok" if i % 50 else "error",
                prompt_tokens=200 + i % 800,
                completion_tokens=20 + i % 300,
                cached_tokens=(200 + i % 800) // 4,
                pool="online",
                replica="online-1",
                ttft_ms=40,
                duration_ms=900,
                started_at=at,
                finished_at=at + timedelta(milliseconds=900),
            )
        )
    return out


def _spool(records: list[Any]) -> None:
    from billing.spool import FIELD, USAGE_STREAM
    from contract import encode
    from controlplane.redis import redis_sync

    pipe = redis_sync().pipeline(transaction=False)
    for i, record in enumerate(records):
        pipe.xadd(USAGE_STREAM, {FIELD: encode(record)})
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()


def _drain(flushers: int) -> float:
    """Seconds for ``flushers`` threads (each its own database connection, as separate
    worker processes would be) to empty the spool through ``usage_spool_flush``."""
    from django.db import connection

    from billing.spool import spool_length, usage_spool_flush

    def run() -> None:
        try:
            while spool_length():
                usage_spool_flush()
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(flushers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def ledger(quick: bool, invoice_rows: int) -> dict[str, Any]:
    from django.db import connection

    import billing.services
    import billing.spool
    from billing.models import UsageRecord
    from controlplane.redis import redis_sync

    n = 20_000 if quick else 200_000
    tenant_ids, key_ids = _ledger_world(1000)
    redis_sync().flushdb()
    out: dict[str, Any] = {"records": n}
    new_insert = billing.services.usage_records_insert
    phases = {
        "before": (_orm_insert, 1, 2_000),
        "before_2_flushers": (_orm_insert, 2, 2_000),
        "copy": (new_insert, 1, billing.spool.FLUSH_BATCH),
        "copy_2_flushers": (new_insert, 2, billing.spool.FLUSH_BATCH),
    }
    runs: dict[str, list[float]] = {name: [] for name in phases}
    batch = billing.spool.FLUSH_BATCH
    rounds = 1 if quick else 2
    for round_ in range(rounds):
        for name, (insert, flushers, size) in phases.items():
            with connection.cursor() as cur:
                cur.execute("TRUNCATE billing_usagerecord")
            records = _records(n, tenant_ids, key_ids, f"{name}-{round_}")
            _spool(records)
            before = insert is _orm_insert
            if before:
                _schema_before(True)
            billing.services.usage_records_insert = insert
            billing.spool.FLUSH_BATCH = size
            try:
                seconds = _drain(flushers)
            finally:
                billing.services.usage_records_insert = new_insert
                billing.spool.FLUSH_BATCH = batch
                if before:
                    _schema_before(False)
            ids = list(UsageRecord.objects.values_list("request_id", flat=True))
            assert len(ids) == n and len(set(ids)) == n, (name, len(ids), len(set(ids)))
            runs[name].append(n / seconds)
    for name, rates in runs.items():
        out[f"{name}_records_per_s"] = max(rates)
    base = out["before_records_per_s"]
    out["speedup"] = out["copy_records_per_s"] / base
    out["speedup_2_flushers"] = out["copy_2_flushers_records_per_s"] / base
    out["speedup_2_flushers_vs_before_2"] = (
        out["copy_2_flushers_records_per_s"] / out["before_2_flushers_records_per_s"]
    )
    out.update(_invoice(invoice_rows, tenant_ids, key_ids))
    return out


def _invoice(rows: int, tenant_ids: list[int], key_ids: list[int]) -> dict[str, Any]:
    """A month of ``rows`` records, a tenth of them the heaviest tenant's (as in
    ``bench.ledger``), built server side; then that tenant's invoice, exact from the ledger,
    at a tenth and at the whole of the size (the per-row cost and how it grows)."""
    from django.db import connection

    from billing.invoicing import invoice_compute
    from tenants.models import Tenant

    heavy = Tenant.objects.get(pk=tenant_ids[0])
    out: dict[str, Any] = {}
    with connection.cursor() as cur:
        cur.execute("TRUNCATE billing_usagerecord, billing_invoiceline, billing_invoice")
    built = 0
    for target in (rows // 10, rows):
        chunk = 1_000_000
        with connection.cursor() as cur:
            for lo in range(built, target, chunk):
                hi = min(target, lo + chunk)
                cur.execute(
                    """
                    INSERT INTO billing_usagerecord
                      (request_id, tenant_id, api_key_id, model, adapter, route, endpoint, mode,
                       status, prompt_tokens, completion_tokens, cached_tokens, cost_micros,
                       pool, replica, ttft_ms, duration_ms, error, started_at, finished_at)
                    SELECT 'i' || g, t[1 + n], k[1 + n], 'scale-model', '', '',
                           'chat.completions', 'online', 'ok', p, c, p / 4,
                           p * 15 / 100 + c * 60 / 100, 'online', 'online-1', 40, 900, '',
                           ts, ts + interval '900 milliseconds'
                    FROM (
                      SELECT g, %(t)s::bigint[] AS t, %(k)s::bigint[] AS k,
                        CASE WHEN g %% 10 = 0 THEN 0 ELSE (g * 7919) %% %(tenants)s END AS n,
                        200 + (g * 31) %% 800 AS p, 20 + (g * 17) %% 300 AS c,
                        %(month)s::timestamptz
                          + ((g %% %(rows)s)::float8 * 2678400.0 / %(rows)s::float8)
                            * interval '1 second' AS ts
                      FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g
                    ) s
                    """,
                    {
                        "t": tenant_ids,
                        "k": key_ids,
                        "tenants": len(tenant_ids),
                        "month": datetime(MONTH.year, MONTH.month, 1, tzinfo=UTC),
                        "rows": target,
                        "lo": lo,
                        "hi": hi - 1,
                    },
                )
            cur.execute("VACUUM ANALYZE billing_usagerecord")
            cur.execute("SELECT pg_total_relation_size('billing_usagerecord')")
            size = cur.fetchone()[0]
        built = target
        times = []
        for _ in range(3):
            start = time.perf_counter()
            invoice_compute(tenant=heavy, period_start=MONTH)
            times.append(time.perf_counter() - start)
        out[f"invoice_heaviest_s_at_{target}"] = min(times)
        out[f"ledger_bytes_at_{target}"] = size
    out["invoice_rows"] = rows
    return out


# --- the driver ----------------------------------------------------------------------------


def _report(results: dict[str, Any]) -> None:
    for section, figures in results.items():
        print(f"[{section}]")
        for name, value in figures.items():
            if isinstance(value, float):
                value = f"{value:,.3f}" if value < 100 else f"{value:,.0f}"
            print(f"  {name}: {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: under five minutes")
    parser.add_argument("--only", default="admission,catalog,keys,ledger")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="admission: also one pool and the limits on a Redis Cluster (3 masters, started "
        "from the machine's redis-server), against one Redis",
    )
    parser.add_argument(
        "--invoice-rows",
        type=int,
        default=None,
        help="ledger rows for the invoice figure (default 20,000,000; quick 500,000)",
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    setup()
    results: dict[str, Any] = {}
    started = time.monotonic()
    if "admission" in only or "keys" in only:
        from bench import scale_admission

        if "admission" in only:
            cluster = cluster_start() if args.cluster else None
            try:
                results["admission"] = scale_admission.admission(
                    args.quick, REDIS_URL, cluster.url if cluster else None
                )
            finally:
                if cluster:
                    cluster_stop(cluster)
        if "keys" in only:
            results["keys"] = scale_admission.keys(args.quick, DB_URL, REDIS_URL)
    if "catalog" in only:
        results["catalog"] = catalog(args.quick)
    if "ledger" in only:
        rows = args.invoice_rows or (500_000 if args.quick else 20_000_000)
        results["ledger"] = ledger(args.quick, rows)
    _report(results)
    print(f"({time.monotonic() - started:.0f} s)")
    out = ROOT / "var" / "bench-results" / ("scale-quick.json" if args.quick else "scale.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({**results, "config": vars(args), "at": datetime.now(UTC).isoformat()})
    )


if __name__ == "__main__":
    main()
