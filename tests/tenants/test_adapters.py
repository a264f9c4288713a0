"""LoRA adapter uploads through the control API: validation in the background, content-
addressed storage, rejections with a reason and nothing left behind, roles and outsiders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from inference.models import Model, Pool
from inference.services import adapter_retire
from tenants.models import Adapter, AuditEvent
from tenants.services import adapter_validate
from tests.conftest import TenantPeople, client_for
from tests.tenants.test_lora import (
    GOOD,
    TINY_CONFIG,
    config,
    lora_tensors,
    safetensors,
    zip_of,
)

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

    entry = catalog_build()["adapters"]["acme/support-bot"]["versions"]["1"]
    cached = tmp_path / "cache" / adapter.sha256
    assert entry["path"] == str(cached)
    assert sorted(p.name for p in cached.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (cached / "adapter_config.json").read_bytes() == config()
    # A new engine node with an empty cache: the next publish fetches it again.
    for part in cached.iterdir():
        part.unlink()
    cached.rmdir()
    assert catalog_build()["adapters"]["acme/support-bot"]["versions"]["1"]["path"] == str(cached)
    assert (cached / "adapter_model.safetensors").is_file()

    with django_capture_on_commit_callbacks(execute=False):
        client_for(people.owner).post("/api/tenants/acme/adapters/support-bot/1/delete/")
    assert adapter_retire(adapter_id=adapter.pk)
    assert not cached.exists()
    from django.core.files.storage import default_storage

    assert not default_storage.exists(f"adapters/{adapter.sha256}/adapter_config.json")
