"""LoRA adapter uploads through the control API: validation in the background, content-
addressed storage, rejections with a reason and nothing left behind, roles and outsiders."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from kombu import Queue

from adapters.models import Adapter
from adapters.services import adapter_reject, adapter_validate
from adapters.tasks import adapter_validate_task, adapters_stuck_reject_task
from adapters.validation import WEIGHTS
from controlplane.celery import app as celery_app
from devkit.adapters import TINY_CONFIG, config, lora_tensors, safetensors
from fleet.models import Model, Pool
from inference.services import adapter_retire
from tenants.models import AuditEvent
from tests.adapters.test_validation import (
    GOOD,
    MB,
    STORED_GOOD,
    _patch_zip,
    deeply_nested,
    tar_of,
    zip_of,
)
from tests.conftest import TenantPeople, client_for, test_database_url
from tests.live import wait_for

UPLOAD = "/api/tenants/acme/adapters/upload/"


@pytest.fixture
def served(people: TenantPeople, settings: Any, tmp_path: Path) -> Path:
    settings.MEDIA_ROOT = tmp_path / "media"
    model = Model.objects.create(
        name="tiny-chat",
        served_name="tiny-chat",
        context_length=1024,
        supports_lora=True,
        architecture=TINY_CONFIG,
    )
    Pool.objects.create(name="online", kind="dedicated", model=model, max_lora_rank=8)
    return Path(settings.MEDIA_ROOT)


def _files(media: Path) -> list[str]:
    return sorted(p.relative_to(media).as_posix() for p in media.rglob("*") if p.is_file())


def _two_files(cfg: bytes | None = None, weights: bytes | None = None) -> dict[str, Any]:
    return {
        "adapter_config": SimpleUploadedFile("adapter_config.json", cfg or config()),
        "adapter_model": SimpleUploadedFile(
            "adapter_model.safetensors", weights or safetensors(lora_tensors())
        ),
    }


def _upload(people: TenantPeople, persona: str, capture: Any, **files: Any) -> Any:
    with capture() as queued:
        response = client_for(people.user(persona)).post(
            UPLOAD, {"name": "support-bot", **files}, format="multipart"
        )
    return response, queued


def test_upload_validate_and_store_content_addressed(
    people: TenantPeople, served: Path, django_capture_on_commit_callbacks: Any
) -> None:
    response, queued = _upload(
        people, "developer", django_capture_on_commit_callbacks, **_two_files()
    )
    assert response.status_code == 202, response.content
    body = response.json()
    assert (body["status"], body["version"], body["model"]) == (
        "validating",
        1,
        "acme/support-bot:1",
    )
    assert len(queued) == 1  # validation is queued after commit
    adapter = adapter_validate(adapter_id=Adapter.objects.get().pk)
    assert adapter.status == "ready" and adapter.rank == 8
    assert adapter.target_modules == ["q_proj", "v_proj"]
    assert _files(served) == [
        f"adapters/{adapter.sha256}/adapter_config.json",
        f"adapters/{adapter.sha256}/adapter_model.safetensors",
    ]
    detail = client_for(people.viewer).get("/api/tenants/acme/adapters/support-bot/1/").json()
    assert detail["status"] == "ready" and detail["sha256"] == adapter.sha256
    assert detail["base_model"] == "tiny-chat"
    # The same name again is the next version; the same content shares the stored files.
    _upload(people, "owner", django_capture_on_commit_callbacks, **_two_files())
    second = adapter_validate(adapter_id=Adapter.objects.get(version=2).pk)
    assert second.sha256 == adapter.sha256 and len(_files(served)) == 2
    assert {e.action for e in AuditEvent.objects.filter(tenant=people.tenant)} >= {
        "adapter.upload",
        "adapter.ready",
    }


def test_an_archive_upload(
    people: TenantPeople, served: Path, django_capture_on_commit_callbacks: Any
) -> None:
    archive = SimpleUploadedFile("bot.zip", zip_of(GOOD))
    response, _ = _upload(people, "admin", django_capture_on_commit_callbacks, archive=archive)
    assert response.status_code == 202
    assert adapter_validate(adapter_id=Adapter.objects.get().pk).status == "ready"


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        (
            {"archive": SimpleUploadedFile("x.zip", zip_of({**GOOD, "../../evil": b"x"}))},
            "points outside the adapter",
        ),
        (
            {"archive": SimpleUploadedFile("x.zip", zip_of({**GOOD, "a/model.bin": b"\x80"}))},
            "pickle-based",
        ),
        (_two_files(cfg=config(base_model_name_or_path="gpt2")), "trained for 'gpt2'"),
        (_two_files(cfg=config(r=64)), "maximum LoRA rank of 8"),
        (_two_files(weights=safetensors(lora_tensors(rank=4))), "must be [8, 128]"),
        (_two_files(weights=b"\x80\x04\x95 a pickle"), "not a safetensors file"),
    ],
)
def test_bad_adapters_are_rejected_with_a_reason_and_leave_nothing(
    people: TenantPeople,
    served: Path,
    django_capture_on_commit_callbacks: Any,
    files: dict[str, Any],
    reason: str,
) -> None:
    response, _ = _upload(people, "developer", django_capture_on_commit_callbacks, **files)
    assert response.status_code == 202
    adapter = adapter_validate(adapter_id=Adapter.objects.get().pk)
    assert adapter.status == "rejected" and reason in adapter.reason
    assert _files(served) == []  # no staging left, nothing stored
    shown = client_for(people.developer).get("/api/tenants/acme/adapters/support-bot/1/").json()
    assert shown["status"] == "rejected" and reason in shown["reason"]


def test_delete_removes_the_files_once_unused(
    people: TenantPeople, served: Path, django_capture_on_commit_callbacks: Any
) -> None:
    for _ in range(2):
        _upload(people, "owner", django_capture_on_commit_callbacks, **_two_files())
    for adapter in Adapter.objects.all():
        adapter_validate(adapter_id=adapter.pk)
    client = client_for(people.owner)
    first, second = Adapter.objects.order_by("version")
    # The retire task (run here in-process) unloads from the engines, then removes files.
    with django_capture_on_commit_callbacks():
        assert client.post("/api/tenants/acme/adapters/support-bot/1/delete/").status_code == 204
    assert adapter_retire(adapter_id=first.pk)
    assert len(_files(served)) == 2  # version 2 still uses them
    with django_capture_on_commit_callbacks():
        assert client.post("/api/tenants/acme/adapters/support-bot/2/delete/").status_code == 204
    assert adapter_retire(adapter_id=second.pk)
    assert _files(served) == []
    assert client.get("/api/tenants/acme/adapters/support-bot/2/").status_code == 404
    assert client.get("/api/tenants/acme/adapters/").json()["results"] == []


@pytest.mark.parametrize(
    ("persona", "list_status", "upload_status"),
    [
        ("owner", 200, 202),
        ("admin", 200, 202),
        ("developer", 200, 202),
        ("finance", 200, 403),
        ("viewer", 200, 403),
        ("outsider", 404, 404),
        ("staff", 200, 202),
    ],
)
def test_who_may_see_and_upload(
    people: TenantPeople,
    served: Path,
    django_capture_on_commit_callbacks: Any,
    persona: str,
    list_status: int,
    upload_status: int,
) -> None:
    client = client_for(people.user(persona))
    assert client.get("/api/tenants/acme/adapters/").status_code == list_status
    response, _ = _upload(people, persona, django_capture_on_commit_callbacks, **_two_files())
    assert response.status_code == upload_status
    if upload_status != 202:
        assert not Adapter.objects.exists() and _files(served) == []


def test_outsiders_cannot_reach_an_adapter(
    people: TenantPeople, served: Path, django_capture_on_commit_callbacks: Any
) -> None:
    _upload(people, "owner", django_capture_on_commit_callbacks, **_two_files())
    client = client_for(people.outsider)
    for url in (
        "/api/tenants/acme/adapters/support-bot/1/",
        "/api/tenants/globex/adapters/support-bot/1/",
    ):
        assert client.get(url).status_code == 404
    assert client.post("/api/tenants/acme/adapters/support-bot/1/delete/").status_code == 404
    assert client.post("/api/tenants/globex/adapters/support-bot/1/delete/").status_code == 404
    assert Adapter.objects.get().deleted_at is None


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "Bad Name!", **_two_files()}, "name"),
        ({"name": "bot"}, "files"),
        ({"name": "bot", "adapter_config": SimpleUploadedFile("c.json", config())}, "files"),
    ],
)
def test_bad_uploads_get_400_and_store_nothing(
    people: TenantPeople, served: Path, data: dict[str, Any], field: str
) -> None:
    response = client_for(people.owner).post(UPLOAD, data, format="multipart")
    assert response.status_code == 400 and field in response.json()
    assert not Adapter.objects.exists() and _files(served) == []


def test_oversized_uploads_get_413(people: TenantPeople, served: Path, settings: Any) -> None:
    settings.ADAPTER_MAX_BYTES = 10_000
    response = client_for(people.owner).post(
        UPLOAD, {"name": "bot", **_two_files()}, format="multipart"
    )
    assert response.status_code == 413 and "10,000 bytes" in response.json()["detail"]
    assert not Adapter.objects.exists() and _files(served) == []


def test_with_storage_without_local_paths_engines_get_a_cached_copy(
    people: TenantPeople,
    served: Path,
    settings: Any,
    tmp_path: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    """S3-like storage (Django's in-memory storage: no local paths either): the engines load
    from a copy in ADAPTER_CACHE_DIR, fetched from storage once and removed with the files."""
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {"BACKEND": "django.core.files.storage.InMemoryStorage"},
    }
    settings.ADAPTER_CACHE_DIR = tmp_path / "cache"
    _upload(people, "owner", django_capture_on_commit_callbacks, **_two_files())
    adapter = adapter_validate(adapter_id=Adapter.objects.get().pk)
    assert adapter.status == "ready"
    assert _files(served) == []  # nothing on the filesystem storage: it is all in "S3"

    from inference.catalog import catalog_build

    entry = catalog_build().adapters["acme/support-bot"].versions["1"]
    cached = tmp_path / "cache" / adapter.sha256
    assert entry.path == str(cached)
    assert sorted(p.name for p in cached.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (cached / "adapter_config.json").read_bytes() == config()
    # A new engine node with an empty cache: the next publish fetches it again.
    for part in cached.iterdir():
        part.unlink()
    cached.rmdir()
    assert catalog_build().adapters["acme/support-bot"].versions["1"].path == str(cached)
    assert (cached / "adapter_model.safetensors").is_file()

    with django_capture_on_commit_callbacks(execute=False):
        client_for(people.owner).post("/api/tenants/acme/adapters/support-bot/1/delete/")
    assert adapter_retire(adapter_id=adapter.pk)
    assert not cached.exists()
    from django.core.files.storage import default_storage

    assert not default_storage.exists(f"adapters/{adapter.sha256}/adapter_config.json")


# --- Every upload ends in a verdict ---------------------------------------------------------


def _nested_header() -> bytes:
    raw = b'{"a": ' + deeply_nested(100_000) + b"}"
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        (
            # 60 KB uploaded; its README (skipped) inflates to 16 MiB, past the 1 MiB cap.
            {"archive": ("bot.tar.gz", tar_of({"a/README.md": bytes(16 * MB), **STORED_GOOD}))},
            "far more than an adapter",
        ),
        (
            {
                "adapter_config": (
                    "adapter_config.json",
                    config()[:-1] + b', "x": ' + deeply_nested() + b"}",
                )
            },
            "adapter_config.json is nested too deeply",
        ),
        ({"adapter_model": ("adapter_model.safetensors", _nested_header())}, "nested too deeply"),
        (
            {"archive": ("bot.zip", _patch_zip(zip_of(STORED_GOOD), f"a/{WEIGHTS}", flag=0x1))},
            "is encrypted",
        ),
        (
            {"archive": ("bot.zip", _patch_zip(zip_of(STORED_GOOD), f"a/{WEIGHTS}", crc_xor=1))},
            "The .zip archive is damaged (BadZipFile)",
        ),
    ],
)
def test_content_that_used_to_leave_a_version_validating_is_rejected(
    people: TenantPeople,
    served: Path,
    settings: Any,
    django_capture_on_commit_callbacks: Any,
    files: dict[str, tuple[str, bytes]],
    reason: str,
) -> None:
    settings.ADAPTER_MAX_BYTES = 1 * MB
    uploads = {part: SimpleUploadedFile(name, data) for part, (name, data) in files.items()}
    if "archive" not in uploads:
        uploads = {**_two_files(), **uploads}
    response, _ = _upload(people, "developer", django_capture_on_commit_callbacks, **uploads)
    assert response.status_code == 202, response.content
    adapter_validate_task.apply((Adapter.objects.get().pk,))
    shown = client_for(people.developer).get("/api/tenants/acme/adapters/support-bot/1/").json()
    assert shown["status"] == "rejected" and reason in shown["reason"], shown
    assert _files(served) == []  # staging emptied, nothing stored


def test_storage_failures_are_retried_then_rejected_and_staging_removed(
    people: TenantPeople, served: Path, django_capture_on_commit_callbacks: Any
) -> None:
    """Django's own file storage, with its adapters/ location unusable (a file where the
    directory must be): every try fails writing, then the version gets a verdict."""
    _upload(people, "developer", django_capture_on_commit_callbacks, **_two_files())
    (served / "adapters").write_text("in the way of the adapters/ directory")
    adapter = Adapter.objects.get()
    assert _files(served) != ["adapters"]  # the upload is staged
    adapter_validate_task.apply((adapter.pk,))  # eager: each retry runs at once
    adapter.refresh_from_db()
    retries = settings.ADAPTER_VALIDATION_RETRIES
    assert adapter.status == "rejected", adapter.reason
    assert f"Validation failed {retries + 1} times" in adapter.reason
    assert "NotADirectoryError" in adapter.reason and "not because of the adapter" in adapter.reason
    assert _files(served) == ["adapters"]  # the staged upload is gone
    assert adapter.staging_path == ""
    events = AuditEvent.objects.filter(tenant=people.tenant, action="adapter.rejected")
    assert events.count() == 1


def test_versions_stuck_validating_are_rejected_by_the_sweep(
    people: TenantPeople, served: Path, django_capture_on_commit_callbacks: Any
) -> None:
    """A worker killed at the hard time limit, or a task lost with Redis: nothing stays
    validating past the deadline, and its staging goes with the verdict."""
    for _ in range(3):
        _upload(people, "developer", django_capture_on_commit_callbacks, **_two_files())
    stuck, recent, left_over = Adapter.objects.order_by("version")
    Adapter.objects.filter(pk=stuck.pk).update(created_at=timezone.now() - timedelta(minutes=31))
    # A verdict whose staging the storage failed to remove at the time.
    Adapter.objects.filter(pk=left_over.pk).update(status="rejected", reason="earlier")
    schedule = settings.CELERY_BEAT_SCHEDULE
    assert any(e["task"] == adapters_stuck_reject_task.name for e in schedule.values())

    adapters_stuck_reject_task.apply()

    stuck.refresh_from_db()
    assert stuck.status == "rejected"
    assert "did not finish within 30 minutes" in stuck.reason and stuck.staging_path == ""
    recent.refresh_from_db()
    assert recent.status == "validating"
    left_over.refresh_from_db()
    assert (left_over.reason, left_over.staging_path) == ("earlier", "")
    assert [f for f in _files(served) if f.startswith("adapter-uploads/")] == [
        f"{recent.staging_path}{part}" for part in ("adapter_config", "adapter_model")
    ]
    # The late task, when it comes, changes nothing.
    assert adapter_validate(adapter_id=stuck.pk).status == "rejected"


def test_validation_runs_on_its_own_queue() -> None:
    router = celery_app.amqp.router
    assert router.route({}, adapter_validate_task.name)["queue"].name == "adapters"
    # Probes, metering and rollups stay on the default queue.
    for task in ("inference.tasks.replicas_probe_all", "billing.tasks.daily_usage_refresh_task"):
        assert router.route({}, task)["queue"].name == "celery"


@pytest.mark.django_db(transaction=True)
def test_a_validation_that_hangs_is_stopped_by_the_time_limit(
    people: TenantPeople, served: Path, tmp_path: Path
) -> None:
    """A real worker for the adapters queue (as the Procfile runs it) and storage that never
    answers (a FIFO nobody writes: open() blocks): the soft time limit rejects the version."""
    response = client_for(people.developer).post(
        UPLOAD, {"name": "support-bot", **_two_files()}, format="multipart"
    )
    assert response.status_code == 202
    adapter = Adapter.objects.get()
    staged = served / adapter.staging_path / "adapter_config"
    staged.unlink()
    os.mkfifo(staged)
    # The upload's message carries this process's limits (300 s): send one with 1 s instead.
    with celery_app.connection_for_write() as connection:
        assert Queue("adapters", channel=connection.default_channel).purge() == 1
    adapter_validate_task.apply_async((adapter.pk,), soft_time_limit=1, time_limit=31)
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "INFERPLANE_MEDIA_ROOT": str(served),
        "INFERPLANE_ADAPTER_VALIDATION_SECONDS": "1",
    }
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "controlplane", "worker"),
                *("-Q", "adapters", "-n", "adapters-test@%h", "--concurrency", "1"),
                *("--without-heartbeat", "--without-gossip", "--without-mingle"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            # The verdict, then its staging area emptied (after the verdict's commit: waiting
            # on the status alone stopped the worker between the two in a fresh-clone run).
            wait_for(
                lambda: Adapter.objects.filter(
                    pk=adapter.pk, status="rejected", staging_path=""
                ).exists(),
                timeout=60,
            )
        except AssertionError:
            raise AssertionError(log_path.read_text()[-3000:]) from None
        finally:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=30)
    adapter.refresh_from_db()
    assert "Validation took too long (over 1 seconds)" in adapter.reason
    assert adapter.staging_path == "" and _files(served) == []


# --- Quotas ---------------------------------------------------------------------------------


def test_an_upload_over_the_version_quota_is_refused_and_stores_nothing(
    people: TenantPeople, served: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.ADAPTER_MAX_VERSIONS_PER_TENANT = 2
    for _ in range(2):
        response, _ = _upload(
            people, "developer", django_capture_on_commit_callbacks, **_two_files()
        )
        assert response.status_code == 202
    stored = _files(served)
    response, queued = _upload(
        people, "developer", django_capture_on_commit_callbacks, **_two_files()
    )
    assert response.status_code == 400
    (message,) = response.json()["non_field_errors"]
    assert "already keeps 2 adapter versions, the most allowed (2)" in message
    assert Adapter.objects.count() == 2 and _files(served) == stored and queued == []
    # Another tenant's member learns nothing about acme, and globex has its own quota.
    outsider = client_for(people.outsider)
    assert (
        outsider.post(UPLOAD, {"name": "x", **_two_files()}, format="multipart").status_code == 404
    )
    with django_capture_on_commit_callbacks():
        theirs = outsider.post(
            "/api/tenants/globex/adapters/upload/",
            {"name": "x", **_two_files()},
            format="multipart",
        )
    assert theirs.status_code == 202 and Adapter.objects.filter(tenant__slug="globex").count() == 1
    # Deleted versions stop counting.
    with django_capture_on_commit_callbacks():
        client_for(people.owner).post("/api/tenants/acme/adapters/support-bot/1/delete/")
    response, _ = _upload(people, "developer", django_capture_on_commit_callbacks, **_two_files())
    assert response.status_code == 202


def test_an_upload_over_the_byte_quota_is_refused(
    people: TenantPeople, served: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    one = sum(len(f.read()) for f in _two_files().values())
    settings.ADAPTER_MAX_BYTES_PER_TENANT = one + one // 2
    response, _ = _upload(people, "developer", django_capture_on_commit_callbacks, **_two_files())
    assert response.status_code == 202  # validating: counted by its staged size
    response, _ = _upload(people, "developer", django_capture_on_commit_callbacks, **_two_files())
    assert response.status_code == 400
    (message,) = response.json()["non_field_errors"]
    assert f"would bring Acme's adapters to {2 * one:,} bytes" in message.replace(
        people.tenant.name, "Acme"
    )
    assert Adapter.objects.count() == 1
    # A rejected version keeps no bytes.
    adapter_reject(adapter_id=Adapter.objects.get().pk, reason="for the test")
    response, _ = _upload(people, "developer", django_capture_on_commit_callbacks, **_two_files())
    assert response.status_code == 202


def test_the_dashboard_shows_the_quota_as_a_form_error(
    people: TenantPeople, served: Path, settings: Any
) -> None:
    settings.ADAPTER_MAX_VERSIONS_PER_TENANT = 1
    client = Client()
    client.force_login(people.developer)
    url = reverse("dashboard:adapters", args=["acme"])
    first = client.post(url, {"name": "bot", **_two_files()})
    assert first.status_code == 302
    stored = _files(served)
    second = client.post(url, {"name": "bot", **_two_files()})
    assert second.status_code == 400
    assert "the most allowed (1)" in second.content.decode()
    assert Adapter.objects.count() == 1 and _files(served) == stored
    outsider = Client()
    outsider.force_login(people.outsider)
    assert outsider.post(url, {"name": "bot", **_two_files()}).status_code == 404
    assert Adapter.objects.count() == 1
