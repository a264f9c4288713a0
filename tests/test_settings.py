"""Settings come from the environment and fail loudly; production is locked down."""

from __future__ import annotations

import secrets

from tests.conftest import run_manage

PRODUCTION = {
    "INFERPLANE_ENV": "production",
    "SECRET_KEY": secrets.token_urlsafe(64),
    "ALLOWED_HOSTS": "inferplane.example.com",
    "DEBUG": "0",
}


def test_check_deploy_is_clean_in_production() -> None:
    result = run_manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_development_defaults_do_not_pass_check_deploy() -> None:
    """Without production settings the check does complain: the test above means something."""
    result = run_manage("check", "--deploy", "--fail-level", "WARNING", env={"DEBUG": "1"})
    assert result.returncode != 0
    assert "security.W018" in result.stderr  # DEBUG on


def test_production_refuses_to_start_without_a_secret_key() -> None:
    env = {**PRODUCTION, "SECRET_KEY": ""}
    result = run_manage("check", env=env)
    assert result.returncode != 0
    assert "SECRET_KEY must be set when INFERPLANE_ENV=production" in result.stderr


def test_production_refuses_debug() -> None:
    result = run_manage("check", env={**PRODUCTION, "DEBUG": "1"})
    assert result.returncode != 0
    assert "DEBUG must be off when INFERPLANE_ENV=production" in result.stderr


def test_bad_values_fail_loudly() -> None:
    result = run_manage("check", env={"DEBUG": "maybe"})
    assert result.returncode != 0
    assert "DEBUG='maybe' is not a boolean" in result.stderr
    result = run_manage("check", env={"INFERPLANE_PROBE_INTERVAL_SECONDS": "ten"})
    assert "INFERPLANE_PROBE_INTERVAL_SECONDS='ten' is not an integer" in result.stderr
    result = run_manage("check", env={"INFERPLANE_ENV": "prod"})
    assert "INFERPLANE_ENV='prod' must be one of" in result.stderr


def test_debug_is_off_unless_asked() -> None:
    show = "from django.conf import settings; print('DEBUG', settings.DEBUG)"
    result = run_manage("shell", "--no-imports", "-c", show, env={"DEBUG": ""})
    assert result.stdout.strip() == "DEBUG False", result.stderr
    result = run_manage("shell", "--no-imports", "-c", show, env={"DEBUG": "1"})
    assert result.stdout.strip() == "DEBUG True", result.stderr


def test_s3_storage_is_configured_from_the_environment() -> None:
    show = (
        "from django.core.files.storage import storages; s = storages['default']; "
        "print(type(s).__name__, s.bucket_name, s.endpoint_url)"
    )
    env = {
        "INFERPLANE_STORAGE": "s3",
        "INFERPLANE_S3_BUCKET": "adapters",
        "INFERPLANE_S3_ENDPOINT_URL": "http://minio.internal:9000",
    }
    result = run_manage("shell", "--no-imports", "-c", show, env=env)
    assert result.stdout.split() == ["S3Storage", "adapters", "http://minio.internal:9000"], (
        result.stderr
    )
    missing = run_manage("check", env={"INFERPLANE_STORAGE": "s3"})
    assert missing.returncode != 0 and "INFERPLANE_S3_BUCKET must be set" in missing.stderr
    wrong = run_manage("check", env={"INFERPLANE_STORAGE": "ftp"})
    assert "INFERPLANE_STORAGE='ftp' must be one of" in wrong.stderr
