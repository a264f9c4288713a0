"""Dashboard pages, server side: who sees what, outsiders get 404, forms refuse bad input with
form errors, and an API key's secret is shown once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone

from billing.services import daily_usage_refresh, usage_records_insert
from tenants.models import Adapter, ApiKey, User
from tenants.services import api_key_create
from tests.conftest import TenantPeople
from tests.tenants.test_adapters import served  # noqa: F401  (fixture)
from tests.tenants.test_lora import config, lora_tensors, safetensors

pytestmark = pytest.mark.django_db

PAGES = ["", "keys/", "adapters/"]


def browser(user: User | None) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


def test_pages_need_a_login() -> None:
    for url in ("/app/", "/app/t/acme/", "/app/t/acme/keys/"):
        response = browser(None).get(url)
        assert response.status_code == 302 and response["Location"].startswith("/app/login/")
    assert browser(None).get("/app/login/").status_code == 200


def test_login_with_a_wrong_password_is_a_form_error(people: TenantPeople) -> None:
    response = browser(None).post("/app/login/", {"username": "owner", "password": "nope"})
    assert response.status_code == 200 and b"Please enter a correct username" in response.content
    good = browser(None).post(
        "/app/login/", {"username": "owner", "password": "correct horse battery staple"}
    )
    assert good.status_code == 302 and good["Location"] == "/app/"


@pytest.mark.parametrize("persona", ["owner", "admin", "developer", "finance", "viewer", "staff"])
def test_members_and_staff_see_every_page(people: TenantPeople, persona: str) -> None:
    client = browser(people.user(persona))
    for page in PAGES:
        response = client.get(f"/app/t/acme/{page}")
        assert response.status_code == 200, page
        assert b"Acme" in response.content


def test_an_outsider_gets_404_for_every_page_and_action(people: TenantPeople) -> None:
    key = api_key_create(tenant=people.tenant, name="k", created_by=people.owner).api_key
    client = browser(people.outsider)
    for page in PAGES:
        assert client.get(f"/app/t/acme/{page}").status_code == 404
    for action in (
        "keys/",
        f"keys/{key.pk}/revoke/",
        f"keys/{key.pk}/rotate/",
        "adapters/",
        "adapters/bot/1/delete/",
    ):
        assert client.post(f"/app/t/acme/{action}", {"name": "x"}).status_code == 404
    assert client.get("/app/t/no-such-tenant/").status_code == 404
    ApiKey.objects.get(pk=key.pk).is_active  # noqa: B018
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None
    assert ApiKey.objects.filter(tenant=people.tenant).count() == 1


def test_home_takes_a_user_to_their_tenant(people: TenantPeople) -> None:
    response = browser(people.viewer).get("/app/")
    assert response.status_code == 302 and response["Location"] == "/app/t/acme/"
    lonely = User.objects.create_user("lonely", password="x")
    assert b"No tenant yet" in browser(lonely).get("/app/").content


def test_a_new_key_is_shown_once_then_only_its_prefix(people: TenantPeople) -> None:
    client = browser(people.developer)
    response = client.post("/app/t/acme/keys/", {"name": "support bot", "scopes": ["inference"]})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(tenant=people.tenant)
    body = response.content.decode()
    secret = body.split("data-secret>")[1].split("<")[0]
    assert secret.startswith("sk-ip-") and key.prefix in secret
    assert key.scopes == ["inference"] and key.created_by == people.developer
    again = client.get("/app/t/acme/keys/").content.decode()
    assert secret not in again and key.display_prefix in again


@pytest.mark.parametrize("persona", ["finance", "viewer"])
def test_roles_without_key_creation_see_no_form_and_cannot_post(
    people: TenantPeople, persona: str
) -> None:
    client = browser(people.user(persona))
    assert b"Create a key" not in client.get("/app/t/acme/keys/").content
    assert (
        client.post("/app/t/acme/keys/", {"name": "x", "scopes": ["inference"]}).status_code == 403
    )
    assert not ApiKey.objects.exists()


def test_bad_key_input_gets_form_errors(people: TenantPeople) -> None:
    client = browser(people.owner)
    response = client.post("/app/t/acme/keys/", {"name": "", "scopes": ["nonsense"]})
    assert response.status_code == 400
    assert b"This field is required" in response.content
    assert b"Select a valid choice" in response.content
    assert not ApiKey.objects.exists()


def test_developers_revoke_their_own_keys_only(people: TenantPeople) -> None:
    mine = api_key_create(tenant=people.tenant, name="mine", created_by=people.developer).api_key
    theirs = api_key_create(tenant=people.tenant, name="theirs", created_by=people.owner).api_key
    client = browser(people.developer)
    page = client.get("/app/t/acme/keys/").content.decode()
    assert f"keys/{mine.pk}/revoke/" in page and f"keys/{theirs.pk}/revoke/" not in page
    assert client.post(f"/app/t/acme/keys/{theirs.pk}/revoke/").status_code == 403
    assert client.post(f"/app/t/acme/keys/{mine.pk}/revoke/").status_code == 302
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert mine.revoked_at is not None and theirs.revoked_at is None
    assert browser(people.owner).post(f"/app/t/acme/keys/{theirs.pk}/revoke/").status_code == 302


def test_rotating_shows_the_new_key_once_and_keeps_the_old_for_the_grace(
    people: TenantPeople,
) -> None:
    old = api_key_create(tenant=people.tenant, name="svc", created_by=people.owner).api_key
    response = browser(people.owner).post(
        f"/app/t/acme/keys/{old.pk}/rotate/", {"grace_hours": "2"}
    )
    assert response.status_code == 200
    new = ApiKey.objects.get(rotated_from=old)
    assert f"sk-ip-{new.prefix}".encode() in response.content
    old.refresh_from_db()
    assert old.expires_at is not None
    assert timedelta(hours=1.9) < old.expires_at - timezone.now() < timedelta(hours=2.1)
    bad = browser(people.owner).post(f"/app/t/acme/keys/{new.pk}/rotate/", {"grace_hours": "-1"})
    assert bad.status_code == 400


def test_overview_numbers_and_chart_come_from_the_rollups(people: TenantPeople) -> None:
    key = api_key_create(tenant=people.tenant, name="k", created_by=people.owner).api_key
    now = datetime.now(UTC)
    records = [
        {
            "request_id": f"r{i}",
            "tenant_id": people.tenant.pk,
            "api_key_id": key.pk,
            "model": "tiny-chat",
            "endpoint": "chat.completions",
            "mode": "online",
            "status": "ok" if i else "error",
            "error": "" if i else "engine failed mid-stream: boom",
            "prompt_tokens": 100,
            "completion_tokens": 20,
            "cost_micros": 1_500_000,
            "started_at": now.isoformat(),
            "finished_at": now.isoformat(),
        }
        for i in range(3)
    ]
    usage_records_insert(records)
    daily_usage_refresh(tenant_id=people.tenant.pk, day=now.date())
    page = browser(people.viewer).get("/app/t/acme/").content.decode()
    assert 'data-metric="requests">3<' in page and 'data-metric="tokens">360<' in page
    assert 'data-metric="spend">$4.50<' in page
    assert "engine failed mid-stream: boom" in page
    assert '"model": "tiny-chat"' in page and "360" in page.split('id="usage-data"')[1]


def test_adapter_upload_form_and_delete(
    people: TenantPeople,
    served: Path,  # noqa: F811
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = browser(people.developer)
    bad = client.post("/app/t/acme/adapters/", {"name": "Bad Name!"})
    assert bad.status_code == 400 and not Adapter.objects.exists()
    with django_capture_on_commit_callbacks():
        response = client.post(
            "/app/t/acme/adapters/",
            {
                "name": "bot",
                "adapter_config": SimpleUploadedFile("adapter_config.json", config()),
                "adapter_model": SimpleUploadedFile(
                    "adapter_model.safetensors", safetensors(lora_tensors())
                ),
            },
        )
    assert response.status_code == 302
    adapter = Adapter.objects.get(tenant=people.tenant, name="bot")
    rows = client.get("/app/t/acme/adapters/rows/").content.decode()
    assert "validating" in rows and 'hx-trigger="every 2s"' in rows
    viewer = browser(people.viewer)
    assert b"Upload a version" not in viewer.get("/app/t/acme/adapters/").content
    assert viewer.post("/app/t/acme/adapters/bot/1/delete/").status_code == 403
    with django_capture_on_commit_callbacks():
        assert client.post("/app/t/acme/adapters/bot/1/delete/").status_code == 302
    adapter.refresh_from_db()
    assert adapter.deleted_at is not None


def test_an_oversized_upload_is_refused_before_it_is_read(
    people: TenantPeople,
    served: Path,  # noqa: F811
    settings: Any,
) -> None:
    settings.ADAPTER_MAX_BYTES = 1000
    response = browser(people.owner).post(
        "/app/t/acme/adapters/",
        {"name": "bot", "archive": SimpleUploadedFile("a.zip", b"x" * 5000)},
    )
    assert response.status_code == 413 and b"limited to 1,000 bytes" in response.content
    assert not Adapter.objects.exists()
