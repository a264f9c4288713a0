"""``GET /metrics`` names tenants and their token and dollar counters: it answers only the
bearer of ``INFERPLANE_METRICS_TOKEN``, and no one at all while none is configured. A scrape
reads Redis alone: the database is never asked, however many batches and tenants."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from asgiref.testing import ApplicationCommunicator
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from batches.gauges import batch_gauges_store
from batches.models import Batch, Line
from controlplane.metrics import MetricsConsumer, _render
from inference.catalog import catalog_publish
from inference.services import model_ensure, pool_ensure
from tenants.services import api_key_create
from tests.asgi import asgi_answer
from tests.factories import TenantFactory

# channels closes stale database connections around a consumer's handler.
pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "a-metrics-token"


def _scrape(authorization: str | None) -> dict[str, Any]:
    headers = [(b"authorization", authorization.encode())] if authorization else []

    async def scrape() -> dict[str, Any]:
        # As the ASGI server calls it (channels' HttpCommunicator needs daphne installed).
        scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": headers}
        communicator = ApplicationCommunicator(MetricsConsumer.as_asgi(), scope)
        await communicator.send_input({"type": "http.request", "body": b""})
        start, body = await asgi_answer(communicator)
        return {"status": start["status"], "body": body}

    return asyncio.run(scrape())


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {TOKEN}", "Bearer "])
def test_an_outsider_gets_401_and_no_metric(authorization: str | None) -> None:
    with override_settings(INFERPLANE_METRICS_TOKEN=TOKEN):
        response = _scrape(authorization)
    assert response["status"] == 401
    assert b"Authorization: Bearer <INFERPLANE_METRICS_TOKEN>" in response["body"]
    assert b"inferplane_" not in response["body"]


def test_without_a_configured_token_no_one_gets_the_metrics() -> None:
    with override_settings(INFERPLANE_METRICS_TOKEN=""):
        for authorization in (None, "Bearer ", "Bearer anything"):
            response = _scrape(authorization)
            assert response["status"] == 403
            assert b"until INFERPLANE_METRICS_TOKEN is set" in response["body"]


def test_the_token_gets_the_exposition() -> None:
    with override_settings(INFERPLANE_METRICS_TOKEN=TOKEN):
        response = _scrape(f"Bearer {TOKEN}")
    assert response["status"] == 200
    assert b"inferplane_state_up" in response["body"]


def test_a_scrape_asks_the_database_nothing(django_assert_num_queries: Any) -> None:
    """The replicas' states come from the catalog the probes publish, the batch counts from
    the sweeper's (``batches.gauges``): a scrape, every 15 s from every Prometheus on every
    web process, runs no query."""
    tenant = TenantFactory.create()
    key = api_key_create(tenant=tenant, name="k", created_by=None).api_key
    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool_ensure(name="online", kind="dedicated", model=model, replica_urls=["http://gpu-a:8000"])
    batch = Batch.objects.create(
        tenant=tenant,
        api_key=key,
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        status=Batch.Status.IN_PROGRESS,
        expires_at=datetime.now(UTC) + timedelta(hours=1),
    )
    Line.objects.bulk_create(
        Line(batch=batch, number=n, custom_id=str(n), body={}) for n in range(1, 4)
    )
    catalog_publish()
    batch_gauges_store()
    with django_assert_num_queries(0), override_settings(INFERPLANE_METRICS_TOKEN=TOKEN):
        text = _render("")[0].decode()
    samples = [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]

    def value(name: str, **labels: str) -> float:
        return sum(v for n, found, v in samples if n == name and labels.items() <= found.items())

    assert value("inferplane_batch_lines", state="pending") == 3
    assert value("inferplane_pool_replicas", pool="online", kind="dedicated") == 1
    assert 0 < value("inferplane_batch_deadline_seconds") <= 3600
    for source in ("catalog", "batches", "redis"):
        assert value("inferplane_state_up", source=source) == 1
