"""Quotas and retention for files and batches (docs/isolation.md): stored bytes, open batches
and batch tokens queued, per tenant with the operator's defaults; past one, OpenAI's error
shape naming it and nothing stored; files and finished batches' lines deleted after the
retention period. Real Postgres and Redis; the services as the web process and the worker
call them, the command as an operator runs it."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.core.files.storage import default_storage
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone

from batches import quotas
from batches.files import file_store_output, file_upload, files_expired_delete
from batches.models import Batch, File, Line
from batches.services import batch_create, batches_purge
from batches.validation import batch_validate
from batches.wire import batch_object
from inference.catalog import catalog_publish
from inference.gateway.errors import ApiError
from inference.services import model_ensure, pool_ensure
from tenants.models import Tenant
from tenants.services import api_key_create, tenant_limits_update
from tests.conftest import TenantPeople, client_for, run_manage

pytestmark = pytest.mark.django_db(transaction=True)
MIB = 1024 * 1024


def _jsonl(n: int, *, content: str = "Say hello.", **body: Any) -> bytes:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": content}],
                **body,
            },
        }
        for i in range(n)
    ]
    return b"\n".join(orjson.dumps(line) for line in lines) + b"\n"


def _upload(tenant: Tenant, data: bytes, name: str = "input.jsonl") -> File:
    return file_upload(tenant=tenant, upload=SimpleUploadedFile(name, data), purpose="batch")


def _stored(tenant: Tenant) -> list[str]:
    """The files in storage under the tenant's folder."""
    root = Path(default_storage.path(f"files/{tenant.pk}"))
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.fixture(autouse=True)
def _own_storage(settings: Any, tmp_path: Path) -> None:
    """A storage folder of the test's own: what it finds there, it stored."""
    settings.MEDIA_ROOT = str(tmp_path)


@pytest.fixture
def tenant(people: TenantPeople) -> Tenant:
    return people.tenant


def _twice_at_once(action: Callable[[], str]) -> list[str]:
    """``action`` in two threads released together: what each returned, or the code of the
    ApiError it raised, in the order they ended."""
    from django.db import connection

    outcomes: list[str] = []
    start = threading.Barrier(2)

    def run() -> None:
        try:
            start.wait()
            outcomes.append(action())
        except ApiError as error:
            outcomes.append(str(error.code))
        finally:
            connection.close()  # the thread's own connection

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


# --- stored bytes ----------------------------------------------------------------------------


def test_an_upload_past_the_storage_quota_is_refused_and_nothing_is_stored(tenant: Tenant) -> None:
    tenant_limits_update(tenant=tenant, actor=None, limits={"storage_mb": 1})
    first = _upload(tenant, _jsonl(2000))  # ~295 KB
    assert first.bytes > MIB // 4
    _upload(tenant, _jsonl(2000))
    _upload(tenant, _jsonl(2000))
    before = (File.objects.filter(tenant=tenant).count(), _stored(tenant))
    with pytest.raises(ApiError) as refused:
        _upload(tenant, _jsonl(2000))
    error = refused.value
    assert (error.status, error.code, error.type) == (
        400,
        "storage_quota_exceeded",
        "invalid_request_error",
    )
    assert "storage quota of 1 MiB" in error.message
    assert (File.objects.filter(tenant=tenant).count(), _stored(tenant)) == before
    # Deleting a file frees its share: the same upload then fits.
    File.objects.filter(pk=first.pk).delete()
    _upload(tenant, _jsonl(2000))


def test_another_tenants_files_do_not_count(people: TenantPeople) -> None:
    tenant_limits_update(tenant=people.tenant, actor=None, limits={"storage_mb": 1})
    for _ in range(4):
        _upload(people.other_tenant, _jsonl(2000))
    _upload(people.tenant, _jsonl(2000))  # fits: the 1.2 MB are globex's


def test_two_uploads_at_once_cannot_both_take_the_last_of_the_quota(tenant: Tenant) -> None:
    """Each fits alone, not both: the check under the tenant's lock lets one through."""
    data = _jsonl(5000)  # ~740 KB: two make more than 1 MiB
    tenant_limits_update(tenant=tenant, actor=None, limits={"storage_mb": 1})
    outcomes = _twice_at_once(lambda: _upload(tenant, data).purpose and "stored")
    assert sorted(outcomes) == ["storage_quota_exceeded", "stored"]
    assert len(_stored(tenant)) == 1 and File.objects.filter(tenant=tenant).count() == 1


# --- open batches and queued tokens ----------------------------------------------------------


def _key(tenant: Tenant) -> Any:
    return api_key_create(tenant=tenant, name="ci", created_by=None).api_key


def test_a_batch_past_the_open_batches_quota_is_refused(tenant: Tenant) -> None:
    tenant_limits_update(tenant=tenant, actor=None, limits={"max_open_batches": 2})
    key = _key(tenant)
    source = _upload(tenant, _jsonl(1))
    params = {"input_file_id": source.id, "endpoint": "/v1/chat/completions"}
    params["completion_window"] = "24h"
    batch_create(api_key=key, params=params)
    batch_create(api_key=key, params=params)
    with pytest.raises(ApiError) as refused:
        batch_create(api_key=key, params=params)
    assert (refused.value.status, refused.value.code) == (400, "open_batches_quota_exceeded")
    assert "2 batches not yet finished" in refused.value.message
    assert Batch.objects.filter(tenant=tenant).count() == 2
    # One that finished no longer counts.
    Batch.objects.filter(tenant=tenant).update(status=Batch.Status.COMPLETED)
    batch_create(api_key=key, params=params)


def test_a_tenant_over_its_storage_by_batch_outputs_starts_no_more_batches(
    tenant: Tenant,
) -> None:
    """A batch's own output is always written (the work is done) and counts: a tenant it
    took past its storage quota starts no batch until it deletes files."""
    key = _key(tenant)
    source = _upload(tenant, _jsonl(1))
    params = {"input_file_id": source.id, "endpoint": "/v1/chat/completions"}
    params["completion_window"] = "24h"
    output = file_store_output(
        tenant=tenant, name="b_output.jsonl", content=io.BytesIO(b"x" * (2 * MIB)), lines=1
    )
    tenant_limits_update(tenant=tenant, actor=None, limits={"storage_mb": 2})
    with pytest.raises(ApiError) as refused:
        batch_create(api_key=key, params=params)
    assert refused.value.code == "storage_quota_exceeded"
    assert not Batch.objects.filter(tenant=tenant).exists()
    File.objects.filter(pk=output.pk).delete()
    batch_create(api_key=key, params=params)


def test_two_retries_of_one_batch_at_the_quotas_edge_both_get_the_batch(
    tenant: Tenant,
) -> None:
    """The same Idempotency-Key sent twice at once, one batch short of the quota: one makes
    it, the other waits for the tenant's lock and gets the same batch (not a quota error)."""
    tenant_limits_update(tenant=tenant, actor=None, limits={"max_open_batches": 1})
    key = _key(tenant)
    source = _upload(tenant, _jsonl(1))
    params = {"input_file_id": source.id, "endpoint": "/v1/chat/completions"}
    params["completion_window"] = "24h"
    got = _twice_at_once(
        lambda: batch_create(api_key=key, params=params, idempotency_key="job-1")[0].pk
    )
    made = Batch.objects.get(tenant=tenant)
    assert got == [made.pk, made.pk]


def _spot_pool() -> None:
    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool_ensure(name="spot", kind="spot", model=model, replica_urls=["http://127.0.0.1:9"])
    catalog_publish()


def test_a_batch_whose_tokens_do_not_fit_the_queue_fails_with_token_limit_exceeded(
    tenant: Tenant,
) -> None:
    """OpenAI's behaviour: the batch fails at validation, its error names the limit; the
    tokens are estimated (prompt characters / 4, plus max_tokens times n)."""
    _spot_pool()
    key = _key(tenant)
    tenant_limits_update(tenant=tenant, actor=None, limits={"batch_queue_tokens": 1000})
    # 40 lines of 11 prompt tokens ("user" and 40 characters) and max_tokens 10: 840; fits.
    first = _upload(tenant, _jsonl(40, content="x" * 40, max_tokens=10))
    params = {"input_file_id": first.id, "endpoint": "/v1/chat/completions"}
    params["completion_window"] = "24h"
    fits, _ = batch_create(api_key=key, params=params)
    fits = batch_validate(batch_id=fits.pk)
    assert fits.status == Batch.Status.IN_PROGRESS, fits.errors
    assert fits.estimated_tokens == 840
    # 315 more do not fit beside the 840 queued.
    second = _upload(tenant, _jsonl(15, content="x" * 40, max_tokens=10))
    over, _ = batch_create(api_key=key, params=params | {"input_file_id": second.id})
    over = batch_validate(batch_id=over.pk)
    assert over.status == Batch.Status.FAILED
    shaped = batch_object(over)
    [error] = shaped["errors"]["data"]
    assert error["code"] == "token_limit_exceeded"
    assert "315 tokens" in error["message"] and "840" in error["message"]
    assert "1,000 tokens" in error["message"]
    assert not Line.objects.filter(batch=over).exists()  # nothing of it will run
    # Once the first is done, the same file fits.
    Batch.objects.filter(pk=fits.pk).update(status=Batch.Status.COMPLETED)
    again, _ = batch_create(api_key=key, params=params | {"input_file_id": second.id})
    assert batch_validate(batch_id=again.pk).status == Batch.Status.IN_PROGRESS


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 0}, 11 + 1024),
        ({"messages": [{"role": "user", "content": "x" * 41}], "max_tokens": 5}, 12 + 5),
        ({"prompt": "x" * 8, "max_completion_tokens": 3, "n": 2}, 2 + 6),
        ({"prompt": [1, 2, 3], "max_tokens": 4}, 3 + 4),  # token ids count one each
        ({"prompt": ["ab", "cd", "ef"], "max_tokens": 10, "n": 2}, 2 + 3 * 2 * 10),
        ({"prompt": "x", "max_tokens": 5, "n": 1, "best_of": 3}, 1 + 15),
        # No bound of its own: each sequence counts at the model's context.
        ({"prompt": "x", "n": 2}, 1 + 2 * 1024),
        ({"prompt": "x", "max_tokens": "lots"}, 1 + 1024),
    ],
)
def test_a_lines_tokens_are_estimated(body: dict[str, Any], tokens: int) -> None:
    assert quotas.estimated_tokens(body, context_length=1024) == tokens


# --- retention -------------------------------------------------------------------------------


def test_files_expire_after_the_retention_period_or_sooner_if_asked(
    tenant: Tenant, settings: Any
) -> None:
    settings.INFERPLANE_RETENTION_DAYS = 30
    kept = _upload(tenant, _jsonl(1))
    assert kept.expires_at is not None
    assert abs(kept.expires_at - (timezone.now() + timedelta(days=30))) < timedelta(minutes=1)
    soon = file_upload(
        tenant=tenant,
        upload=SimpleUploadedFile("a.jsonl", _jsonl(1)),
        purpose="batch",
        expires_after_seconds=3600,
    )
    assert soon.expires_at is not None and soon.expires_at < kept.expires_at
    File.objects.filter(pk=kept.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert files_expired_delete() == 1
    assert list(File.objects.filter(tenant=tenant)) == [soon]
    assert _stored(tenant) == [f"{soon.pk}.jsonl"]


def test_a_finished_batchs_lines_are_deleted_after_the_retention_period_its_counts_kept(
    tenant: Tenant, settings: Any
) -> None:
    settings.INFERPLANE_RETENTION_DAYS = 30
    key = _key(tenant)
    source = _upload(tenant, _jsonl(1))
    made = []
    for days in (31, 29):
        batch = Batch.objects.create(
            tenant=tenant,
            api_key=key,
            input_file_id=source.id,
            endpoint="/v1/chat/completions",
            status=Batch.Status.COMPLETED,
            expires_at=timezone.now(),
            completed_at=timezone.now() - timedelta(days=days),
        )
        for number, state in ((1, Line.State.DONE), (2, Line.State.FAILED)):
            Line.objects.create(
                batch=batch,
                number=number,
                custom_id=f"r{number}",
                body={"secret": "the tenant's prompt"},
                state=state,
                prompt_tokens=7,
                completion_tokens=5,
            )
        made.append(batch)
    old, recent = made
    shown = batch_object(old)
    assert batches_purge() == 1
    assert not Line.objects.filter(batch=old).exists()
    assert Line.objects.filter(batch=recent).count() == 2
    old.refresh_from_db()
    after = batch_object(old)
    assert (
        after["request_counts"]
        == shown["request_counts"]
        == {
            "total": 2,
            "completed": 1,
            "failed": 1,
        }
    )
    assert after["usage"] == shown["usage"] and after["usage"]["total_tokens"] == 24
    assert batches_purge() == 0  # once


# --- where an operator sets them -------------------------------------------------------------


def test_tenant_limits_shows_and_sets_limits_and_quotas(tenant: Tenant) -> None:
    shown = run_manage("tenant_limits", "acme")
    assert shown.returncode == 0, shown.stderr
    assert "storage_mb: 10240 (default)" in shown.stdout
    assert "rpm: unlimited" in shown.stdout
    changed = run_manage(
        "tenant_limits",
        "acme",
        "--storage-mb",
        "500",
        "--open-batches",
        "3",
        "--batch-queue-tokens",
        "2000000",
        "--rpm",
        "60",
    )
    assert changed.returncode == 0, changed.stderr
    assert "storage_mb: 500\n" in changed.stdout and "max_open_batches: 3\n" in changed.stdout
    tenant.refresh_from_db()
    assert (tenant.storage_mb, tenant.max_open_batches, tenant.batch_queue_tokens) == (
        500,
        3,
        2_000_000,
    )
    assert tenant.rpm == 60
    cleared = run_manage("tenant_limits", "acme", "--storage-mb", "none", "--rpm", "none")
    assert cleared.returncode == 0, cleared.stderr
    after = Tenant.objects.get(pk=tenant.pk)
    assert (after.storage_mb, after.rpm) == (None, None)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nobody"], "no tenant with slug 'nobody'"),
        (["acme", "--storage-mb", "lots"], "--storage-mb must be a whole number"),
        (["acme", "--open-batches", "0"], "--open-batches must be between 1"),
    ],
)
def test_tenant_limits_says_what_is_wrong_in_one_line(
    tenant: Tenant, args: list[str], message: str
) -> None:
    result = run_manage("tenant_limits", *args)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr


def test_the_control_api_reads_and_staff_set_the_quotas(people: TenantPeople) -> None:
    url = reverse("tenants:tenant-limits", kwargs={"slug": "acme"})
    limits = client_for(people.viewer).get(url).json()
    assert (limits["storage_mb"], limits["max_open_batches"]) == (10240, 50)
    assert set(limits["quotas_by_default"]) == set(Tenant.QUOTA_NAMES)
    update = reverse("tenants:tenant-limits-update", kwargs={"slug": "acme"})
    assert client_for(people.owner).post(update, {"storage_mb": 5}).status_code == 403
    assert client_for(people.outsider).post(update, {"storage_mb": 5}).status_code == 404
    refused = client_for(people.staff).post(update, {"storage_mb": 0}, format="json")
    assert refused.status_code == 400 and "storage_mb" in refused.json()
    done = client_for(people.staff).post(update, {"storage_mb": 5}, format="json").json()
    assert done["storage_mb"] == 5 and "storage_mb" not in done["quotas_by_default"]
    again = client_for(people.staff).post(update, {"storage_mb": None}, format="json").json()
    assert again["storage_mb"] == 10240


def test_the_dashboard_limits_page_shows_use_and_staff_change_quotas(
    people: TenantPeople, client: Any
) -> None:
    _upload(people.tenant, _jsonl(10))
    client.force_login(people.viewer)
    page = client.get(reverse("dashboard:limits", kwargs={"slug": "acme"})).content.decode()
    assert 'data-quota="storage_mb"' in page and "10.0\xa0GB" in page
    client.force_login(people.staff)
    form = {"weight": 1, "status": "active", "storage_mb": "7", "max_open_batches": "4"}
    url = reverse("dashboard:limits", kwargs={"slug": "acme"})
    assert client.post(url, form).status_code == 302
    people.tenant.refresh_from_db()
    assert (people.tenant.storage_mb, people.tenant.max_open_batches) == (7, 4)
    bad = client.post(url, form | {"storage_mb": "-1"})
    assert bad.status_code == 400 and "Stored files (MiB)" in bad.content.decode()
