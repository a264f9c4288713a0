"""The management commands, run as an operator runs them (a real process, real database)."""

from __future__ import annotations

import pytest

from fleet.models import Pool
from tenants.models import ApiKey, AuditEvent, Tenant
from tenants.selectors import api_key_authenticate
from tests.conftest import run_manage

pytestmark = pytest.mark.django_db(transaction=True)


def test_create_tenant_with_limits() -> None:
    result = run_manage(
        "create_tenant",
        "initech",
        "--name",
        "Initech",
        "--weight",
        "2",
        "--rpm",
        "60",
        "--tpm",
        "9000",
        "--max-concurrency",
        "4",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "initech"
    tenant = Tenant.objects.get(slug="initech")
    assert (tenant.name, tenant.weight, tenant.rpm, tenant.tpm, tenant.max_concurrency) == (
        "Initech",
        2,
        60,
        9000,
        4,
    )
    event = AuditEvent.objects.get(tenant=tenant, action="tenant.create")
    assert event.actor_label == "system"


def test_create_api_key_prints_a_working_key_last() -> None:
    run_manage("create_tenant", "initech")
    result = run_manage("create_api_key", "initech", "--name", "ci")
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip().splitlines()[-1]
    found = api_key_authenticate(raw_key=key)
    assert found is not None and found.tenant.slug == "initech" and found.name == "ci"
    assert AuditEvent.objects.filter(action="api_key.create", tenant__slug="initech").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["create_tenant", "Bad Slug!"], "lowercase letters"),
        (["create_tenant", "ok", "--rpm", "12o"], "--rpm must be a whole number"),
        (["create_tenant", "ok", "--tpm", "-5"], "--tpm must be between 1"),
        (["create_tenant", "ok", "--weight", "0"], "--weight must be between 1 and 1000"),
        (["create_tenant", "ok", "--max-concurrency", "1e3"], "--max-concurrency must be a whole"),
        (["create_api_key", "nope"], "no tenant with slug 'nope'"),
    ],
)
def test_bad_input_is_one_clear_line_and_nonzero(args: list[str], message: str) -> None:
    result = run_manage(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr
    assert not Tenant.objects.filter(slug="ok").exists()
    assert not ApiKey.objects.exists()


def test_duplicate_slug_is_refused() -> None:
    assert run_manage("create_tenant", "initech").returncode == 0
    result = run_manage("create_tenant", "initech")
    assert result.returncode != 0
    assert (
        result.stderr.strip() == "CommandError: slug: A tenant with slug 'initech' already exists."
    )
    assert Tenant.objects.filter(slug="initech").count() == 1


def test_seed_demo_is_idempotent_and_keeps_a_working_key(tmp_path: object) -> None:
    env = {"INFERPLANE_VAR_DIR": str(tmp_path)}
    first = run_manage("seed_demo", env=env)
    assert first.returncode == 0, first.stderr
    key_file = tmp_path / "demo-api-key"  # type: ignore[operator]
    key = key_file.read_text().strip()
    assert api_key_authenticate(raw_key=key) is not None
    second = run_manage("seed_demo", env=env)
    assert second.returncode == 0, second.stderr
    assert key_file.read_text().strip() == key  # not re-issued while it works
    assert Tenant.objects.filter(slug="demo").count() == 1
    assert ApiKey.objects.filter(tenant__slug="demo").count() == 1
    # The spot pool admits twice its engine's 64 sequences; an operator's setting is kept.
    assert Pool.objects.get(name="batch").max_inflight == 128
    Pool.objects.filter(name="batch").update(max_inflight=32)
    assert run_manage("seed_demo", env=env).returncode == 0
    assert Pool.objects.get(name="batch").max_inflight == 32
    # Revoked (or the database reset): the next seed issues a fresh working key.
    ApiKey.objects.update(revoked_at="2026-01-01T00:00:00Z")
    assert run_manage("seed_demo", env=env).returncode == 0
    assert api_key_authenticate(raw_key=key_file.read_text().strip()) is not None


def test_seed_demo_refuses_a_model_name_that_would_read_as_an_adapter(tmp_path: object) -> None:
    result = run_manage(
        "seed_demo", "--model-name", "Qwen/Qwen2.5-7B", env={"INFERPLANE_VAR_DIR": str(tmp_path)}
    )
    assert result.returncode != 0
    assert result.stderr.strip().startswith("CommandError: --model-name 'Qwen/Qwen2.5-7B'")
    assert "no '/'" in result.stderr and len(result.stderr.strip().splitlines()) == 1
