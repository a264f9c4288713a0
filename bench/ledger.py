"""The ledger at scale: 10 million usage records across 1,000 tenants in PostgreSQL.

Builds (once; kept between runs) a month of records in a database of its own, then times,
each against a naive baseline measured in the same run:
  - one tenant's monthly invoice (goal < 1 s)               vs  the same sums by a full scan
  - the usage API, a month by day (goal < 200 ms)          vs  grouping the ledger per request
  - the usage CSV of the heaviest tenant (goal >= 50,000 rows/s, flat memory)

    .venv/bin/python -m bench.ledger [--records 10000000] [--tenants 1000] [--rebuild]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from datetime import UTC, date, datetime
from typing import Any

from bench.harness import ROOT

DB_URL = os.environ.get(
    "BENCH_LEDGER_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/inferplane_ledger"
)
MONTH = date(2026, 10, 1)
HEAVY_SHARE = 0.10  # tenant 1 sends a tenth of all traffic: the worst case for one tenant


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def setup() -> None:
    os.environ["DATABASE_URL"] = DB_URL
    os.environ["REDIS_URL"] = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")
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


def build(records: int, tenants: int, *, force: bool) -> None:
    """Tenants, keys, prices and ``records`` usage rows over one month, then the rollups."""
    from django.db import connection

    from billing.models import UsageRecord
    from tenants.models import ApiKey, Tenant

    if not force and UsageRecord.objects.count() >= records:
        print(f"ledger already holds {records:,} records (--rebuild to make it again)")
        return
    t0 = time.perf_counter()
    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE billing_usagerecord, billing_dailyusage, billing_invoiceline, "
            "billing_invoice, tenants_apikey, tenants_tenant CASCADE"
        )
    Tenant.objects.bulk_create(
        [Tenant(slug=f"t{i:04d}", name=f"Tenant {i}") for i in range(1, tenants + 1)]
    )
    ids = dict(Tenant.objects.values_list("slug", "pk"))
    ApiKey.objects.bulk_create(
        [
            ApiKey(
                tenant_id=ids[f"t{i:04d}"], name="k", prefix=f"{i:012x}", secret_hash=f"{i:064x}"
            )
            for i in range(1, tenants + 1)
        ]
    )
    first_tenant = min(ids.values())
    first_key = ApiKey.objects.order_by("pk").values_list("pk", flat=True)[0]
    seconds = 31 * 86400
    chunk = 1_000_000
    heavy = int(1 / HEAVY_SHARE)
    with connection.cursor() as cur:
        for lo in range(0, records, chunk):
            hi = min(records, lo + chunk)
            # Ordered by time, as a real ledger is appended; every 10th row is tenant 1's.
            cur.execute(
                """
                INSERT INTO billing_usagerecord
                  (request_id, tenant_id, api_key_id, model, adapter, endpoint, mode, status,
                   prompt_tokens, completion_tokens, cached_tokens, cost_micros, pool, replica,
                   ttft_ms, duration_ms, error, started_at, finished_at, route)
                SELECT md5(g::text), %(t0)s::bigint + n, %(k0)s::bigint + n, m, '',
                       'chat.completions', mode, 'ok', p, c, p / 4,
                       p * 15 / 100 + c * 60 / 100, 'online', 'http://r1',
                       40, 900, '', ts, ts + interval '900 milliseconds', ''
                FROM (
                  SELECT g,
                    CASE WHEN g %% %(heavy)s::bigint = 0 THEN 0
                         ELSE (g * 7919) %% %(tenants)s::bigint END AS n,
                    CASE WHEN g %% 3 = 0 THEN 'big' ELSE 'small' END AS m,
                    CASE WHEN g %% 20 = 0 THEN 'batch' ELSE 'online' END AS mode,
                    200 + (g * 31) %% 800 AS p, 20 + (g * 17) %% 300 AS c,
                    %(month)s::timestamptz
                      + (g::float8 * %(seconds)s::float8 / %(records)s::float8)
                        * interval '1 second' AS ts
                  FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g
                ) s
                """,
                {
                    "t0": first_tenant,
                    "k0": first_key,
                    "heavy": heavy,
                    "tenants": tenants,
                    "month": datetime(MONTH.year, MONTH.month, 1, tzinfo=UTC),
                    "seconds": seconds,
                    "records": records,
                    "lo": lo,
                    "hi": hi - 1,
                },
            )
            print(f"  {hi:,} records ({time.perf_counter() - t0:.0f} s)", flush=True)
        cur.execute(
            """
            INSERT INTO billing_dailyusage
              (day, tenant_id, api_key_id, model, adapter, mode, requests, errors,
               prompt_tokens, completion_tokens, cached_tokens, cost_micros, unpriced)
            SELECT (started_at AT TIME ZONE 'UTC')::date, tenant_id, api_key_id, model, adapter,
                   mode, count(*), count(*) FILTER (WHERE status = 'error'), sum(prompt_tokens),
                   sum(completion_tokens), sum(cached_tokens), coalesce(sum(cost_micros), 0),
                   count(*) FILTER (WHERE cost_micros IS NULL)
            FROM billing_usagerecord GROUP BY 1, 2, 3, 4, 5, 6
            """
        )
        cur.execute("VACUUM ANALYZE billing_usagerecord")
        cur.execute("VACUUM ANALYZE billing_dailyusage")
        cur.execute("SELECT pg_total_relation_size('billing_usagerecord')")
        size = cur.fetchone()[0]
    print(
        f"built {records:,} records in {time.perf_counter() - t0:.0f} s; "
        f"table + indexes {size / 2**30:.2f} GiB"
    )


def _best(fn: Any, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure() -> dict[str, Any]:
    from django.db import connection
    from rest_framework.test import APIClient

    from billing.exports import usage_csv_stream
    from billing.invoicing import invoice_compute, month_bounds
    from tenants.models import Tenant, User

    heavy = Tenant.objects.order_by("pk").first()
    typical = Tenant.objects.order_by("pk")[500]
    assert heavy is not None
    start, end = month_bounds(MONTH)
    results: dict[str, Any] = {}

    # 1. The invoice: indexed sums per model and mode, vs a full scan for the same sums.
    for name, tenant in (("typical", typical), ("heavy", heavy)):
        results[f"invoice_{name}_s"] = _best(
            lambda t=tenant: invoice_compute(tenant=t, period_start=MONTH), runs=3
        )

    def full_scan() -> None:
        with connection.cursor() as cur:
            cur.execute("SET enable_indexscan = off; SET enable_bitmapscan = off")
            cur.execute(
                "SELECT model, mode, count(*), sum(prompt_tokens), sum(cost_micros) "
                "FROM billing_usagerecord WHERE tenant_id = %s AND started_at >= %s "
                "AND started_at < %s GROUP BY 1, 2",
                [typical.pk, start, end],
            )
            cur.fetchall()
            cur.execute("RESET enable_indexscan; RESET enable_bitmapscan")

    results["invoice_full_scan_s"] = _best(full_scan, runs=1)

    # 2. The usage API, a month by day, from the rollups vs grouping the ledger.
    staff, _ = User.objects.get_or_create(username="bench-staff", defaults={"is_staff": True})
    client = APIClient()
    client.force_authenticate(staff)
    params: dict[str, Any] = {
        "tenant": heavy.slug,
        "start_time": int(start.timestamp()),
        "end_time": int(end.timestamp()),
        "limit": 31,
        "group_by": "model",
    }

    def api() -> None:
        response = client.get("/api/usage/", params)
        assert response.status_code == 200 and len(response.json()["data"]) == 31

    results["usage_api_s"] = _best(api)

    def ledger_by_day() -> None:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT (started_at AT TIME ZONE 'UTC')::date, model, count(*), "
                "sum(prompt_tokens), sum(completion_tokens) FROM billing_usagerecord "
                "WHERE tenant_id = %s AND started_at >= %s AND started_at < %s GROUP BY 1, 2",
                [heavy.pk, start, end],
            )
            cur.fetchall()

    results["usage_from_ledger_s"] = _best(ledger_by_day, runs=2)

    # 3. The heavy tenant's CSV: rows per second, and memory before/after.
    async def csv_rows() -> tuple[int, float]:
        rows, peak = 0, _rss_mb()
        async for part in usage_csv_stream(tenant=heavy, start=start, end=end):
            rows += part.count("\n")
            peak = max(peak, _rss_mb())
        return rows - 1, peak

    rss_before = _rss_mb()
    t = time.perf_counter()
    rows, peak = asyncio.run(csv_rows())
    took = time.perf_counter() - t
    results.update(
        csv_rows=rows,
        csv_s=took,
        csv_rows_per_s=rows / took,
        csv_rss_before_mb=rss_before,
        csv_rss_peak_mb=peak,
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args()
    setup()
    build(args.records, args.tenants, force=args.rebuild)
    r = measure()
    print(
        f"invoice, one tenant's month: typical {r['invoice_typical_s'] * 1000:.0f} ms, heaviest "
        f"(10% of all traffic) {r['invoice_heavy_s'] * 1000:.0f} ms | full-scan baseline "
        f"{r['invoice_full_scan_s'] * 1000:.0f} ms "
        f"({r['invoice_full_scan_s'] / r['invoice_typical_s']:.0f}x slower) [goal < 1 s]"
    )
    print(
        f"usage API, a month by day (heaviest tenant): {r['usage_api_s'] * 1000:.0f} ms from the "
        f"rollups | grouping the ledger instead {r['usage_from_ledger_s'] * 1000:.0f} ms "
        f"({r['usage_from_ledger_s'] / r['usage_api_s']:.0f}x) [goal < 200 ms]"
    )
    print(
        f"usage CSV (heaviest tenant): {r['csv_rows']:,} rows in {r['csv_s']:.1f} s = "
        f"{r['csv_rows_per_s']:,.0f} rows/s; RSS {r['csv_rss_before_mb']:.0f} MB before, peak "
        f"{r['csv_rss_peak_mb']:.0f} MB [goal >= 50,000 rows/s, flat memory]"
    )
    out = ROOT / "var" / "bench-results" / "ledger.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import json

    out.write_text(json.dumps({**r, "config": vars(args), "at": datetime.now(UTC).isoformat()}))


if __name__ == "__main__":
    main()
