"""Dashboard pages, server side, with 10 million usage records in the ledger (the database
``bench.ledger`` builds and keeps: one month, 1,000 tenants, one of them 10% of all traffic).

Times every page (the whole Django stack: middleware, session, access checks, queries,
templates; best of 5) for the heaviest tenant, as of the last day of the ledger's month.
Baseline in the same run: the overview's month totals summed from the ledger instead of the
daily rollups. Goal: every page < 300 ms.

    .venv/bin/python -m bench.dashboard [--records 10000000] [--tenants 1000]
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from typing import Any
from unittest import mock

from bench.harness import ROOT
from bench.ledger import MONTH, build, setup

AS_OF = datetime(MONTH.year, MONTH.month, 31, 18, tzinfo=UTC)  # the ledger's last day
GOAL_MS = 300.0


def _best_ms(fn: Any, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1000


def measure() -> dict[str, Any]:
    from django.db import connection
    from django.db.models import Sum
    from django.test import Client

    from billing.invoicing import invoice_compute
    from billing.models import UsageRecord
    from fleet.models import Pool
    from inference.services import model_ensure, pool_ensure
    from tenants.models import ApiKey, Membership, Role, Tenant, User

    heavy = Tenant.objects.order_by("pk").first()
    assert heavy is not None
    owner, _ = User.objects.get_or_create(
        username="bench-owner", defaults={"is_staff": True, "is_superuser": True}
    )
    Membership.objects.get_or_create(tenant=heavy, user=owner, defaults={"role": Role.OWNER})
    invoice = invoice_compute(tenant=heavy, period_start=MONTH)
    batch = _batch_of_ledger_records(heavy)
    key = ApiKey.objects.filter(tenant=heavy).order_by("pk").first()
    assert key is not None
    if not Pool.objects.exists():  # the operator's pool page, with eight replicas
        model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
        urls = [f"http://gpu-{i}:8000" for i in range(8)]
        pool_ensure(name="online", kind="dedicated", model=model, replica_urls=urls)
    pool = Pool.objects.order_by("name").values_list("name", flat=True).first()
    client = Client()
    client.force_login(owner)
    slug = heavy.slug
    month = f"start={MONTH.isoformat()}&end={AS_OF.date().isoformat()}"
    pages = {
        "overview": f"/app/t/{slug}/",
        "API keys": f"/app/t/{slug}/keys/",
        "members": f"/app/t/{slug}/members/",
        "limits": f"/app/t/{slug}/limits/",
        "usage explorer (month)": f"/app/t/{slug}/usage/?{month}",
        "usage CSV (month, rollups)": f"/app/t/{slug}/usage.csv?{month}",
        "invoices": f"/app/t/{slug}/invoices/",
        "invoice detail": f"/app/t/{slug}/invoices/{invoice.pk}/",
        "audit log": f"/app/t/{slug}/audit/",
        "LoRA adapters": f"/app/t/{slug}/adapters/",
        "playground": f"/app/t/{slug}/playground/",
        "API key page": f"/app/t/{slug}/keys/{key.pk}/",
        "moderation": f"/app/t/{slug}/moderation/",
        "batches": f"/app/t/{slug}/batches/",
        f"batch page ({BATCH_LINES:,} lines, cost)": f"/app/t/{slug}/batches/{batch.id}/",
        "operator": "/app/ops/",
        "price book": "/app/ops/prices/",
    }
    pages["operator: a pool (8 replicas)"] = f"/app/ops/pools/{pool}/"
    results: dict[str, Any] = {}
    with mock.patch("django.utils.timezone.now", return_value=AS_OF):
        for name, url in pages.items():

            def get(url: str = url) -> None:
                response = client.get(url)
                assert response.status_code == 200, (url, response.status_code)

            results[name] = _best_ms(get)

        def ledger_month() -> None:  # the overview's totals, from the ledger instead
            UsageRecord.objects.filter(
                tenant=heavy,
                started_at__gte=datetime(MONTH.year, MONTH.month, 1, tzinfo=UTC),
                started_at__lt=AS_OF,
            ).aggregate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"), cost=Sum("cost_micros"))

        results["baseline: overview totals from the ledger"] = _best_ms(ledger_month, runs=2)
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM billing_usagerecord WHERE tenant_id = %s", [heavy.pk])
        results["heavy_tenant_records"] = cur.fetchone()[0]
    return results


BATCH_LINES = 10_000


def _batch_of_ledger_records(tenant: Any) -> Any:
    """A finished batch whose lines are BATCH_LINES of the tenant's ledger records (its page
    sums their cost), made once."""
    from batches.models import Batch, Line
    from billing.models import UsageRecord

    found = Batch.objects.filter(tenant=tenant, metadata__bench="dashboard").first()
    if found is not None:
        return found
    records = UsageRecord.objects.filter(tenant=tenant, api_key__isnull=False).order_by("pk")[
        :BATCH_LINES
    ]
    key = records[0].api_key
    assert key is not None
    batch = Batch.objects.create(
        tenant=tenant,
        api_key=key,
        input_file_id="file-bench",
        endpoint="/v1/chat/completions",
        model="tiny-chat",
        metadata={"bench": "dashboard"},
        status=Batch.Status.COMPLETED,
        expires_at=AS_OF,
    )
    Line.objects.bulk_create(
        Line(
            batch=batch,
            number=i,
            custom_id=f"c{i}",
            body={},
            state=Line.State.DONE,
            request_id=r.request_id,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
        )
        for i, r in enumerate(records.iterator(), start=1)
    )
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--tenants", type=int, default=1000)
    args = parser.parse_args()
    setup()
    build(args.records, args.tenants, force=False)
    r = measure()
    baseline = r.pop("baseline: overview totals from the ledger")
    records = r.pop("heavy_tenant_records")
    print(f"dashboard pages for a tenant with {records:,} records this month (best of 5):")
    for name, ms in r.items():
        print(f"  {name:<28} {ms:7.1f} ms  {'ok' if ms < GOAL_MS else 'OVER'} (goal < 300 ms)")
    print(
        f"baseline: the overview's month totals summed from the ledger take {baseline:.0f} ms "
        f"({baseline / r['overview']:.0f}x the whole overview page from the rollups)"
    )
    out = ROOT / "var" / "bench-results" / "dashboard.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**r, "baseline_ledger_totals_ms": baseline, "records": records}))


if __name__ == "__main__":
    main()
