"""The spot engines' autoscaler (KEDA, platform/k8s/components/keda-batch) counts the batch
lines to run with a query of its own against our database: it must count what it says."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.db import connection
from django.utils import timezone

from batches.models import Batch, Line
from tenants.services import api_key_create
from tests.factories import TenantFactory

SCALER = Path(__file__).parents[2] / "platform/k8s/components/keda-batch/scaledobject.yaml"


def _query() -> str:
    for doc in yaml.safe_load_all(SCALER.read_text()):
        if doc and doc["kind"] == "ScaledObject" and doc["metadata"]["name"] == "vllm-batch":
            return str(doc["spec"]["triggers"][0]["metadata"]["query"])
    raise AssertionError("no ScaledObject vllm-batch")


def _batch(status: str, states: list[str]) -> None:
    tenant = TenantFactory.create()
    key = api_key_create(tenant=tenant, name="k", created_by=None).api_key
    batch = Batch.objects.create(
        tenant=tenant,
        api_key=key,
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        status=status,
        expires_at=timezone.now() + timedelta(hours=24),
    )
    Line.objects.bulk_create(
        Line(batch=batch, number=i, custom_id=f"c{i}", body={}, state=state)
        for i, state in enumerate(states, start=1)
    )


@pytest.mark.django_db
def test_the_scaler_counts_lines_waiting_or_running_in_live_batches() -> None:
    _batch("in_progress", ["pending", "pending", "running", "done", "failed"])
    _batch("cancelling", ["running", "cancelled"])
    _batch("validating", [])
    _batch("completed", ["done", "done"])
    _batch("expired", ["expired", "done"])
    with connection.cursor() as cursor:
        cursor.execute(_query())
        (count,) = cursor.fetchone()
    assert count == 4  # three of the batch in progress, one of the one cancelling
