"""Reads for the dashboard pages. Numbers come from the daily rollups (``DailyUsage``), so a
page costs the same whether the tenant made a thousand requests this month or ten million."""

from __future__ import annotations

import time
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.core.paginator import Page, Paginator
from django.db.models import Q, QuerySet, Sum

from billing.models import DailyUsage, UsageRecord
from billing.selectors import rollup_sums
from fleet.models import Pool
from inference.catalog import catalog_read
from inference.gateway import metrics
from inference.gateway.admission import QueueState, queue_state
from inference.gateway.limits import rejection_counts_key, rejections_key
from inference.gateway.lora import adapters_held
from tenants.models import Tenant


def month_summary(*, tenant: Tenant, today: date) -> dict[str, int]:
    """This calendar month (UTC) so far: requests, errors, tokens, spend (micro-dollars)."""
    sums = DailyUsage.objects.filter(
        tenant=tenant, day__gte=today.replace(day=1), day__lte=today
    ).aggregate(
        requests=Sum("requests"),
        errors=Sum("errors"),
        cache_hits=Sum("cache_hits"),
        prompt=Sum("prompt_tokens"),
        completion=Sum("completion_tokens"),
        cost=Sum("cost_micros"),
    )
    summary = {name: int(value or 0) for name, value in sums.items()}
    summary["tokens"] = summary["prompt"] + summary["completion"]
    return summary


def daily_chart(*, tenant: Tenant, start: date, days: int) -> dict[str, Any]:
    """Tokens per model and spend, per day, for the overview's chart."""
    rows = usage_rows(tenant=tenant, start=start, end=start + timedelta(days=days - 1))
    return usage_chart(rows, start=start, days=days)


def recent_problems(*, tenant: Tenant, limit: int = 10) -> QuerySet[UsageRecord]:
    """The tenant's latest requests that did not end well (a partial index keeps this cheap
    however large the ledger)."""
    return (
        UsageRecord.objects.filter(tenant=tenant)
        .filter(~Q(status__in=[UsageRecord.Status.OK, UsageRecord.Status.CACHE_HIT]))
        .select_related("api_key")
        .order_by("-started_at")[:limit]
    )


USAGE_COLUMNS = ("day", "model", "adapter", "api_key__prefix", "api_key__name", "mode", "priority")


def usage_rows(
    *,
    tenant: Tenant,
    start: date,
    end: date,
    model: str = "",
    api_key_id: int | None = None,
    mode: str = "",
) -> list[dict[str, Any]]:
    """The rollups for ``[start, end]`` (UTC days) and the filters, one row per day, model,
    adapter, key, mode and priority class: what the usage explorer's table, chart and CSV
    all show."""
    rows = DailyUsage.objects.filter(tenant=tenant, day__gte=start, day__lte=end)
    if model:
        rows = rows.filter(model=model)
    if api_key_id is not None:
        rows = rows.filter(api_key_id=api_key_id)
    if mode:
        rows = rows.filter(mode=mode)
    return list(rows.values(*USAGE_COLUMNS).annotate(**rollup_sums()).order_by(*USAGE_COLUMNS))


def usage_chart(rows: list[dict[str, Any]], *, start: date, days: int) -> dict[str, Any]:
    """The explorer's rows as the overview chart's shape: tokens per model, spend, per day."""
    models = sorted({r["model"] for r in rows})
    tokens = {m: [0] * days for m in models}
    spend = [0.0] * days
    for r in rows:
        i = (r["day"] - start).days
        tokens[r["model"]][i] += r["prompt_tokens"] + r["completion_tokens"]
        spend[i] += r["cost_micros"] / 1_000_000
    return {
        "labels": [(start + timedelta(days=i)).isoformat() for i in range(days)],
        "tokens": [{"model": m, "data": tokens[m]} for m in models],
        "spend": [round(v, 6) for v in spend],
    }


def usage_models(*, tenant: Tenant, since: date) -> list[str]:
    """Models with usage since ``since``: the explorer's model choices."""
    return list(
        DailyUsage.objects.filter(tenant=tenant, day__gte=since)
        .values_list("model", flat=True)
        .distinct()
        .order_by("model")
    )


SPARK_WINDOWS = 30  # the last five minutes, in the windows of inference.gateway.metrics
SPARK_WIDTH, SPARK_HEIGHT = 150, 28


def _spark(values: list[float | None], buckets: tuple[float, ...] = ()) -> dict[str, Any]:
    """An SVG sparkline of per-window values (None: nothing served then, a gap): its
    polylines' points, a dot for a window with nothing served beside it (a one-point line
    draws nothing), the latest value and the highest. The values are the upper bounds of the
    histogram buckets that hold them; ``latest_low`` is that bucket's lower bound (from
    ``buckets``), so the page can say "0.1 to 0.25 s" rather than pretend to know 0.25 s."""
    known = [v for v in values if v is not None]
    top = max(known, default=0.0) or 1.0
    step = SPARK_WIDTH / max(1, len(values) - 1)
    lines: list[str] = []
    dots: list[tuple[str, str]] = []
    current: list[tuple[str, str]] = []

    def close() -> None:
        if len(current) == 1:
            dots.append(current[0])
        elif current:
            lines.append(" ".join(f"{x},{y}" for x, y in current))
        current.clear()

    for i, value in enumerate(values):
        if value is None:
            close()
            continue
        y = SPARK_HEIGHT - 2 - (SPARK_HEIGHT - 4) * value / top
        current.append((f"{i * step:.1f}", f"{y:.1f}"))
    close()
    latest = next((v for v in reversed(values) if v is not None), None)
    return {
        "lines": lines,
        "dots": dots,
        "latest": latest,
        "latest_low": max((b for b in buckets if latest is not None and b < latest), default=0.0),
        "top": max(known, default=None),
    }


def ops_sparklines(pools: list[str], *, now: float | None = None) -> dict[str, dict[str, Any]]:
    """Per pool, TTFT and queue wait p95 over the last five minutes, one point per 10 s
    (from the windows the gateway counts in Redis: every web process together)."""
    from controlplane.redis import redis_sync

    window = int((now or time.time()) // metrics.SPARK_WINDOW_SECONDS)
    windows = range(window - SPARK_WINDOWS + 1, window + 1)
    pipe = redis_sync().pipeline(transaction=False)
    for pool in pools:
        for w in windows:
            pipe.hgetall(metrics.spark_key(pool, w))
    replies = iter(pipe.execute())
    found: dict[str, dict[str, Any]] = {}
    for pool in pools:
        counts = [{k.decode(): int(v) for k, v in next(replies).items()} for _ in windows]
        ttft = [metrics.spark_p95(c, "t", metrics.TIME_TO_FIRST_TOKEN_BUCKETS) for c in counts]
        wait = [metrics.spark_p95(c, "w", metrics.QUEUE_WAIT_BUCKETS) for c in counts]
        found[pool] = {
            "ttft": _spark(ttft, metrics.TIME_TO_FIRST_TOKEN_BUCKETS),
            "wait": _spark(wait, metrics.QUEUE_WAIT_BUCKETS),
            "served": sum(c.get("n", 0) for c in counts),
        }
    return found


def ops_snapshot(*, name: str | None = None) -> dict[str, Any]:
    """The operator's view of serving right now: per pool (or the one ``name``d) its replicas
    (state from the last probe; in flight, capacity and adapters from the admission state in
    Redis) and per tenant what runs and what waits."""

    pools = []
    found = Pool.objects.select_related("model").prefetch_related("replicas")
    every = list(found.filter(name=name) if name is not None else found)
    states = {pool.name: queue_state(pool.name) for pool in every}
    # Only the tenants that run or wait somewhere: the page stays light with 1,000 tenants.
    active = {t for state in states.values() for t in (*state.running, *state.waiting)}
    tenants = Tenant.objects.in_bulk(active)
    sparks = ops_sparklines([pool.name for pool in every])
    for pool in every:
        state = states[pool.name]
        replicas = list(pool.replicas.all())
        held = adapters_held(pool.name, [str(r.pk) for r in replicas])
        pools.append(
            {
                "pool": pool,
                "replicas": [
                    {
                        "replica": r,
                        "in_flight": state.in_flight.get(str(r.pk), 0),
                        "adapters": held[str(r.pk)],
                    }
                    for r in replicas
                ],
                "tenants": [
                    {
                        "tenant": tenants.get(t),
                        "running": state.running.get(t, 0),
                        "waiting": state.waiting.get(t, 0),
                    }
                    for t in sorted(set(state.running) | set(state.waiting))
                ],
                "queued": state.queued,
                # What waits in each priority band, e.g. "3 interactive, 12 background".
                "bands": ", ".join(f"{n} {band}" for band, n in state.by_band.items() if n),
                # An online pool lending idle room to batch lines: what runs online, what is
                # lent (sequences), of how much it may lend, and how often it took room back.
                "lending": _lending(pool, state) if state.lend_percent else None,
                "spark": sparks[pool.name],
            }
        )
    return {"pools": pools}


def _lending(pool: Pool, state: QueueState) -> dict[str, int]:
    ready = sum(1 for r in pool.replicas.all() if r.state == r.State.READY)
    return {
        "percent": state.lend_percent,
        "lent": state.lent,
        "online": max(0, sum(state.in_flight.values()) - state.lent),
        "cap": ready * pool.max_inflight * state.lend_percent // 100,
        "reclaimed": state.reclaimed,
    }


OPS_TENANTS_PER_PAGE = 50


def ops_tenants(*, query: str, page: str | int | None) -> Page[Tenant]:
    """The operator's tenant table: a page of 50, by slug, filtered by a search on slug or
    name (a page out of range gives the last one)."""
    tenants = Tenant.objects.order_by("slug")
    if query:
        tenants = tenants.filter(Q(slug__icontains=query) | Q(name__icontains=query))
    return Paginator(tenants, OPS_TENANTS_PER_PAGE).get_page(page)


def playground_models(*, tenant: Tenant) -> list[str]:
    """What the tenant can call online, as ``/v1/models`` lists it (``Catalog.callable_by``
    decides), less the versioned names of its adapters: the base models, then its adapters
    by ``<slug>/<name>`` (their newest version). Not a guard model: it only classifies, and
    chat refuses it."""
    callable_now = catalog_read(tenant_id=tenant.pk).callable_by(tenant.pk)
    return [
        name
        for name, found in callable_now.items()
        if (found.adapter is None or ":" not in name) and found.model.task == "generate"
    ]


REJECTION_REASONS = {
    "requests": "requests per minute",
    "tokens": "tokens per minute",
    "concurrency": "requests in flight",
    "too_large": "request larger than the tokens-per-minute limit",
    "budget": "monthly token budget",
    "spend": "monthly spend budget",
}


def rejections(*, tenant: Tenant, today: date, limit: int = 10) -> dict[str, Any]:
    """The tenant's 429s: this month's count and the latest ones (from Redis, where the
    gateway notes each; nothing is noted for requests that pass)."""
    import orjson
    from redis.exceptions import RedisError

    from controlplane.redis import redis_sync

    try:
        pipe = redis_sync().pipeline(transaction=False)
        pipe.hgetall(rejection_counts_key(tenant.pk, today.strftime("%Y%m")))
        pipe.lrange(rejections_key(tenant.pk), 0, limit - 1)
        counts, latest = pipe.execute()
    except RedisError:
        return {"month": None, "latest": []}
    notes = []
    for raw in latest:
        note = orjson.loads(raw)
        notes.append(
            {
                "at": datetime.fromtimestamp(note["at"], tz=UTC),
                "key": f"sk-ip-{note['key']}…",
                "reason": REJECTION_REASONS.get(note["reason"], note["reason"]),
            }
        )
    return {"month": sum(int(n) for n in counts.values()), "latest": notes}
