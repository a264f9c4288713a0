"""The gateway's /metrics and JSON logs against the ledger, on a live stack of two uvicorn
workers (as `make run` and the image run it), under mixed traffic from many tenants."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from batches.models import Batch, Line
from billing.models import Price, UsageRecord
from dashboard.selectors import ops_sparklines
from fleet.models import Model
from inference.catalog import catalog_publish
from tenants.models import ApiKey, Tenant
from tenants.services import api_key_create, tenant_create
from tests.engines import LOG_DIR, ROOT, Engine
from tests.live import Stack, stack_start, wait_for
from tests.serving import World, world_rows
from tests.test_monitoring import as_promql, dashboard_queries, metric_names

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CAP = 20  # INFERPLANE_METRICS_TENANTS of the stack below
WORKERS = 2
NAME = "metrics"


@pytest.fixture(scope="module")
def metrics_stack(serving_db_url: str) -> Iterator[Stack]:
    log = LOG_DIR / f"{NAME}-web.log"
    start = log.stat().st_size if log.exists() else 0
    stack = stack_start(
        serving_db_url,
        workers=WORKERS,
        name=NAME,
        extra_env={"INFERPLANE_LOG_FORMAT": "json", "INFERPLANE_METRICS_TENANTS": str(CAP)},
    )
    stack.env["LOG_START"] = str(start)
    yield stack
    stack.stop()


def _scrape(stack: Stack) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the exposition, by sample name (``..._total``, ``..._bucket``, …)."""
    response = stack.metrics()
    assert response.status_code == 200
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def _sum(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(
        value
        for found, value in samples.get(name, [])
        if all(found.get(k) == v for k, v in labels.items())
    )


def _tenant(slug: str) -> tuple[Tenant, str]:
    tenant = tenant_create(slug=slug, weight=1, limits={}, actor=None)
    return tenant, api_key_create(tenant=tenant, name="metrics", created_by=None).secret


def _chat(stack: Stack, key: str, body: dict[str, Any], *, path: str = "chat/completions") -> str:
    """One request; its x-request-id (every answer, error or not, carries one)."""
    response = httpx.post(
        f"{stack.url}/v1/{path}",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.headers.get("x-request-id"), response.text
    return response.headers["x-request-id"]


def _cut_off(stack: Stack, key: str) -> None:
    """A stream the client leaves after its first event."""
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            f"{stack.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
        ) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break


def _mixed(stack: Stack, key: str, i: int) -> None:
    chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": f"hello {i}"}]}
    _chat(stack, key, {**chat, "max_tokens": 5 + i})
    _chat(
        stack,
        key,
        {**chat, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
    )
    _chat(
        stack,
        key,
        {"model": "tiny-chat", "prompt": ["one", "two"], "n": 2, "max_tokens": 3},
        path="completions",
    )
    _chat(stack, key, {**chat, "max_tokens": -1})  # refused: invalid_request
    _chat(stack, "sk-ip-not-a-key-" + "x" * 40, chat)  # refused: auth
    _chat(stack, key, {"input": "a calm sea"}, path="moderations")
    _cut_off(stack, key)


def _priced() -> None:
    Price.objects.create(
        model=Model.objects.get(name="tiny-chat"),
        input_per_mtok=Decimal(3),
        cached_input_per_mtok=Decimal(1),
        output_per_mtok=Decimal(15),
        effective_from=datetime.now(UTC) - timedelta(days=1),
    )
    catalog_publish()


def test_the_metrics_and_the_logs_agree_with_the_ledger(
    engine: Engine, metrics_stack: Stack
) -> None:
    world_rows([engine])
    _priced()
    tenants = [_tenant(f"metrics-{i}") for i in range(4)]
    before = _scrape(metrics_stack)
    with ThreadPoolExecutor(8) as pool:
        for future in [
            pool.submit(_mixed, metrics_stack, key, i) for i, (_, key) in enumerate(tenants * 2)
        ]:
            future.result()
    # 2 rounds x 4 tenants x (chat, stream, completions, moderations, cut off)
    metered = 2 * 4 * 5
    wait_for(lambda: UsageRecord.objects.count() == metered, timeout=60)
    records = list(UsageRecord.objects.select_related("tenant"))
    # Every process's scrape is the whole server's (multiprocess mode): two in a row agree.
    after = _scrape(metrics_stack)
    assert _sum(after, "inferplane_requests_total") == _sum(
        _scrape(metrics_stack), "inferplane_requests_total"
    )

    def grew(name: str, **labels: str) -> float:
        return _sum(after, name, **labels) - _sum(before, name, **labels)

    assert grew("inferplane_requests_total") == len(records)
    by = Counter((r.tenant.slug, r.endpoint, r.status) for r in records)
    for (slug, endpoint, status), n in by.items():
        assert (
            grew("inferplane_requests_total", tenant=slug, endpoint=endpoint, status=status) == n
        ), (slug, endpoint, status)
    for slug in {r.tenant.slug for r in records}:
        mine = [r for r in records if r.tenant.slug == slug]
        for kind, field in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
            assert grew("inferplane_tokens_total", tenant=slug, kind=kind) == sum(
                getattr(r, field) for r in mine
            ), (slug, kind)
        assert grew("inferplane_cost_dollars_total", tenant=slug) == pytest.approx(
            sum(r.cost_micros or 0 for r in mine if r.endpoint != "moderations") / 1e6
        )
        assert grew("inferplane_request_errors_total", tenant=slug, type="invalid_request") == 2
        cut = sum(1 for r in mine if r.status == "cut_off")
        assert grew("inferplane_request_errors_total", tenant=slug, type="client_disconnect") == cut
    assert grew("inferplane_request_errors_total", tenant="none", type="auth") == 8
    streamed = sum(1 for r in records if r.endpoint != "moderations")
    assert grew("inferplane_time_to_first_token_seconds_count") == streamed
    assert grew("inferplane_e2e_request_latency_seconds_count") == streamed
    assert grew("inferplane_admission_queue_wait_seconds_count") == streamed
    assert grew("inferplane_moderation_checks_total", stage="api") == 8
    # The pool's state, read from Redis at the scrape: nothing waits or runs any more.
    assert _sum(after, "inferplane_admission_queue_depth", pool="online") == 0
    assert _sum(after, "inferplane_admission_capacity", pool="online") > 0
    assert _sum(after, "inferplane_pool_replicas", pool="online", state="ready") == 1
    # The operator page's sparklines count the same requests (every web process together).
    spark = ops_sparklines(["online"])["online"]
    assert spark["served"] == streamed and spark["ttft"]["latest"] is not None

    # Every line the web server logged is JSON; each completion has one line, with the
    # ledger's request id, and nothing of the prompt.
    start = int(metrics_stack.env["LOG_START"])
    text = (LOG_DIR / f"{NAME}-web.log").read_bytes()[start:].decode()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    completions = [line for line in lines if line.get("logger") == "inferplane.requests"]
    ledger_ids = {r.request_id for r in records if r.endpoint != "moderations"}
    logged = Counter(line["request_id"] for line in completions)
    assert set(logged) >= ledger_ids
    assert all(logged[rid] == 1 for rid in ledger_ids)
    for line in completions:
        if line["request_id"] in ledger_ids:
            record = next(r for r in records if r.request_id == line["request_id"])
            assert (line["status"], line["completion_tokens"]) == (
                record.status,
                record.completion_tokens,
            )
    assert "hello" not in text and "long story" not in text


def test_the_response_carries_the_request_id_the_ledger_and_the_log_carry(
    engine: Engine, metrics_stack: Stack
) -> None:
    world_rows([engine])
    _, key = _tenant("metrics-ids")
    chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    answered = _chat(metrics_stack, key, chat)
    refused = _chat(metrics_stack, key, {**chat, "max_tokens": -1})
    record = wait_for(lambda: UsageRecord.objects.filter(request_id=answered).first())
    assert record.status == "ok"
    assert refused != answered and not UsageRecord.objects.filter(request_id=refused).exists()

    def logged() -> bool:
        start = int(metrics_stack.env["LOG_START"])
        text = (LOG_DIR / f"{NAME}-web.log").read_bytes()[start:].decode()
        return any(
            json.loads(line).get("request_id") == answered for line in text.splitlines() if line
        )

    wait_for(logged, timeout=10)


def test_three_hundred_tenants_keep_every_metric_within_the_cap(
    engine: Engine, metrics_stack: Stack
) -> None:
    world_rows([engine])
    tenants = [_tenant(f"many-{i:03}") for i in range(300)]
    before = _scrape(metrics_stack)
    done = Counter[str]()
    lock = threading.Lock()

    def one(key: str) -> None:
        chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}]}
        _chat(metrics_stack, key, {**chat, "max_tokens": 1})
        _chat(metrics_stack, key, {**chat, "max_tokens": -1})
        with lock:
            done["sent"] += 1

    with ThreadPoolExecutor(12) as pool:
        for future in [pool.submit(one, key) for _, key in tenants]:
            future.result()
    wait_for(lambda: UsageRecord.objects.filter(tenant__slug__startswith="many-").count() == 300)
    after = _scrape(metrics_stack)
    # Each process labels at most CAP tenants; the rest are "other", and nothing is lost.
    for name, samples in after.items():
        values = {labels["tenant"] for labels, _ in samples if "tenant" in labels}
        assert len(values) <= CAP * WORKERS + 2, (name, len(values))  # + "other", "none"
    many = sum(
        value
        for labels, value in after["inferplane_requests_total"]
        if labels["tenant"].startswith("many-") or labels["tenant"] == "other"
    ) - sum(
        value
        for labels, value in before.get("inferplane_requests_total", [])
        if labels["tenant"].startswith("many-") or labels["tenant"] == "other"
    )
    assert many == 300
    assert _sum(after, "inferplane_requests_total", tenant="other") > 0
    assert done["sent"] == 300


def test_the_dashboards_name_only_metrics_a_real_scrape_holds(
    engine: Engine, metrics_stack: Stack
) -> None:
    """Every metric a dashboard panel queries is in a scrape of the live gateway (after the
    traffic above) or of a real vLLM engine that has served a request."""
    world_rows([engine])
    _priced()
    _, key = _tenant("metrics-boards")
    _mixed(metrics_stack, key, 0)
    wait_for(lambda: UsageRecord.objects.filter(tenant__slug="metrics-boards").count() == 5)
    # A batch under way, for the batch dashboard's series (its lines wait: no spot pool here).
    batch = Batch.objects.create(
        tenant=Tenant.objects.get(slug="metrics-boards"),
        api_key=ApiKey.objects.get(tenant__slug="metrics-boards"),
        input_file_id="file-metrics",
        endpoint="/v1/chat/completions",
        status=Batch.Status.IN_PROGRESS,
        expires_at=datetime.now(UTC) + timedelta(hours=24),
    )
    Line.objects.create(batch=batch, number=1, custom_id="a", body={})
    # Counted by the sweeper within a few seconds (batches.gauges), not by the scrape.
    samples: dict[str, list[tuple[dict[str, str], float]]] = wait_for(
        lambda: (
            (found := _scrape(metrics_stack))
            and _sum(found, "inferplane_batch_lines", state="pending") == 1
            and found
        ),
        timeout=30,
    )
    assert 0 < _sum(samples, "inferplane_batch_deadline_seconds") <= 24 * 3600
    scraped = set(samples)
    engine_text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(engine_text):
        scraped |= {sample.name for sample in family.samples}
    rules = yaml.safe_load(
        (ROOT / "platform" / "monitoring" / "rules" / "gateway.yaml").read_text()
    )
    alerts = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    for board, queries in [*dashboard_queries().items(), ("rules/gateway.yaml", alerts)]:
        for query in queries:
            missing = metric_names(as_promql(query)) - scraped
            assert not missing, f"{board}: {query} names {sorted(missing)}, which no scrape has"


def test_one_worker_carries_the_request_id_as_an_exemplar(world: World) -> None:
    """With one web process (no multiprocess files), an OpenMetrics scrape carries each
    TTFT and latency observation's request id, the one the response and the ledger carry."""
    _, key = world.tenant()
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    rid = _chat(world.stack, key, body)
    scraped = world.stack.metrics(accept="application/openmetrics-text; version=1.0.0")
    assert scraped.headers["content-type"].startswith("application/openmetrics-text")
    exemplars = [
        line
        for line in scraped.text.splitlines()
        if line.startswith("inferplane_time_to_first_token_seconds_bucket") and " # {" in line
    ]
    assert any(f'request_id="{rid}"' in line for line in exemplars), exemplars
    assert wait_for(lambda: UsageRecord.objects.filter(request_id=rid).exists())
