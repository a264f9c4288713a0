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
