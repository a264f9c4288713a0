"""The dashboard's Batches page: a tenant's batches with their progress, their files to
download and a cancel button — for the roles that may, and nobody else's batches."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from batches.files import file_store_output
from batches.models import Batch, Line
from tenants.models import Tenant, User
from tenants.services import api_key_create
from tests.conftest import TenantPeople, streamed

pytestmark = pytest.mark.django_db


def _browser(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _batch(tenant: Tenant, status: str, states: list[str], **fields: object) -> Batch:
    key = api_key_create(tenant=tenant, name="k", created_by=None).api_key
    batch = Batch.objects.create(
        tenant=tenant,
        api_key=key,
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        model="tiny-chat",
        status=status,
        expires_at=timezone.now() + timedelta(hours=24),
        **fields,
    )
    Line.objects.bulk_create(
        Line(batch=batch, number=i, custom_id=f"c{i}", body={}, state=state, completion_tokens=5)
        for i, state in enumerate(states, start=1)
    )
    return batch


def test_the_page_shows_each_batch_with_its_progress(people: TenantPeople) -> None:
    running = _batch(people.tenant, "in_progress", ["done", "done", "failed", "pending"])
    _batch(people.other_tenant, "in_progress", ["pending"])  # not ours
    page = _browser(people.viewer).get("/app/t/acme/batches/")
    assert page.status_code == 200
    html = page.content.decode()
    assert running.id in html and html.count("data-batch=") == 1
    assert f'max="4" value="3" aria-label="progress of {running.id}"' in html
    assert "2 done, 1 failed of 4" in html
    assert "hx-trigger" in html  # polled while it runs
    assert "Cancel</button>" not in html  # a viewer cannot cancel


def test_a_developer_cancels_a_running_batch_and_a_finished_one_says_why_not(
    people: TenantPeople,
) -> None:
    running = _batch(people.tenant, "in_progress", ["done", "pending", "pending"])
    page = _browser(people.developer).get("/app/t/acme/batches/")
    assert f"/app/t/acme/batches/{running.id}/cancel/" in page.content.decode()
    answer = _browser(people.developer).post(f"/app/t/acme/batches/{running.id}/cancel/")
    assert answer.status_code == 302
    running.refresh_from_db()
    assert running.status == "cancelling"
    assert set(Line.objects.filter(batch=running).values_list("state", flat=True)) == {
        "done",
        "cancelled",
    }
    done = _batch(people.tenant, "completed", ["done"])
    refused = _browser(people.owner).post(f"/app/t/acme/batches/{done.id}/cancel/")
    assert refused.status_code == 409
    assert "Cannot cancel a batch with status `completed`" in refused.content.decode()


def test_results_download_for_those_who_may_and_nobody_elses(people: TenantPeople) -> None:
    output = file_store_output(
        tenant=people.tenant, name="b_output.jsonl", content=io.BytesIO(b'{"x": 1}\n'), lines=1
    )
    batch = _batch(people.tenant, "completed", ["done"], output_file_id=output.id)
    page = _browser(people.developer).get("/app/t/acme/batches/")
    assert f"/app/t/acme/files/{output.id}/" in page.content.decode()
    got = _browser(people.developer).get(f"/app/t/acme/files/{output.id}/")
    assert got.status_code == 200 and streamed(got) == b'{"x": 1}\n'
    assert _browser(people.viewer).get(f"/app/t/acme/files/{output.id}/").status_code == 403
    assert (
        _browser(people.viewer).post(f"/app/t/acme/batches/{batch.id}/cancel/").status_code == 403
    )
    # Another tenant's owner: acme's page, file and batch are not there for them, even
    # asked for through their own tenant.
    assert _browser(people.outsider).get("/app/t/acme/batches/").status_code == 404
    assert _browser(people.outsider).get(f"/app/t/globex/files/{output.id}/").status_code in {
        403,
        404,
    }
    assert (
        _browser(people.outsider).post(f"/app/t/globex/batches/{batch.id}/cancel/").status_code
        == 404
    )
