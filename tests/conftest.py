"""Fixtures shared by the whole suite.

Everything here is real: PostgreSQL (``DATABASE_URL``), Redis (``REDIS_URL``, a database of
its own) and, for tests marked ``engine``, a vLLM CPU engine started once per session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import TransactionTestCase
from rest_framework.test import APIClient

from devkit.redis_cluster import Cluster, cluster_start, cluster_stop
from inference.gateway.redis import state_use
from tenants.models import Role, Tenant, User
from tests import contract
from tests.factories import MembershipFactory, TenantFactory, UserFactory

pytest_plugins = ["tests.engines", "tests.live", "tests.serving"]


@pytest.fixture(autouse=True, scope="session")
def _engine_api_key() -> None:
    """The engines the tests start require a key (tests.engines); so does this process."""
    from tests.engines import ENGINE_API_KEY

    settings.INFERPLANE_ENGINE_API_KEY = ENGINE_API_KEY


ROOT = Path(__file__).resolve().parent.parent
_DJANGO_FIXTURE_TEARDOWN = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]

contract.install()

# The tests' groups (tests/README.md), marked by the fixtures they use, so that no test can be
# put in the wrong one: ``engine`` starts or needs a vLLM engine, ``stack`` a live stack
# (uvicorn, Celery worker and beat as processes). ``make test-quick`` runs neither. Every
# fixture that gives a test an engine is named ``engine`` or ``*_engine``.
STACK_FIXTURES = frozenset({"serving_db_url", "stack_factory"})
STACK_LOG_LINES = 60  # of each live process's log, shown under a failed test


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if any(name == "engine" or name.endswith("_engine") for name in names):
            item.add_marker(pytest.mark.engine)
        if names & STACK_FIXTURES:
            item.add_marker(pytest.mark.stack)
        if (
            item.get_closest_marker("single_redis")
            and os.environ.get("INFERPLANE_TEST_STATE") == "cluster"
        ):
            item.add_marker(pytest.mark.skip(reason="about one Redis's databases or old keys"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The engines the selected tests use start together (tests/engines.py)."""
    from tests import engines

    for item in session.items:
        engines.wanted |= set(getattr(item, "fixturenames", ())) & set(engines.STARTERS)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An engine started with the others but never taken (its tests were not reached: -x, a
    failure in set-up, Ctrl-C) is stopped too: each runs in a session of its own."""
    from tests import engines

    engines.stop_all()


def pytest_runtest_setup(item: pytest.Item) -> None:
    from tests import live

    live.logs_mark()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test that ran live processes shows the end of what each wrote during it: CI
    runs in a clone that is gone afterwards, and a flake is read from its report or not at all."""
    from tests import live

    report = yield
    if report.failed and call.when != "teardown":
        for path, start in live.SPAWNED_LOGS.items():
            try:
                with path.open("rb") as log:
                    log.seek(start)
                    text = log.read().decode(errors="replace")
            except OSError:
                continue
            if text:
                lines = text.splitlines()[-STACK_LOG_LINES:]
                report.sections.append((f"Captured {path.name} (its end)", "\n".join(lines)))
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What the load beside the tests did, if there was one (``make test-under-load``)."""
    from tests import engines

    for line in engines.load_summaries:
        terminalreporter.write_line(line)


def _flush_outliving_deadlocks(test_case: Any, attempts: int = 5) -> None:
    """A transactional test's flush (one TRUNCATE of every table) takes its locks table by
    table while a live stack's worker may still be writing (a usage record takes its tenant's
    lock after its own table's): PostgreSQL then ends one of the two as a deadlock, and the
    victim is meant to try again (its transaction was rolled back whole). Only the flush is
    retried; a product transaction that is the victim retries in its own code."""
    import psycopg.errors

    for attempt in range(attempts):
        try:
            _DJANGO_FIXTURE_TEARDOWN(test_case)
            return
        except Exception as error:  # flush's CommandError from Django's error from psycopg's
            causes = []
            cause: BaseException | None = error
            while cause is not None:
                causes.append(cause)
                cause = cause.__cause__
            deadlock = any(isinstance(c, psycopg.errors.DeadlockDetected) for c in causes)
            if attempt == attempts - 1 or not deadlock:
                raise


@pytest.fixture(autouse=True, scope="session")
def _flush_retried_after_a_deadlock() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TransactionTestCase, "_fixture_teardown", _flush_outliving_deadlocks)
        yield


@pytest.fixture(autouse=True)
def _openai_contract() -> Iterator[None]:
    """Every answer a live stack gave this test under /v1 matched OpenAI's published schema
    (tests/contract: checked as the test read it, through the SDK or plain httpx)."""
    contract.LOG.reset()
    yield
    violations = contract.LOG.take()
    if violations:
        shown = "\n".join(violations[:20])
        more = f"\n… and {len(violations) - 20} more" if len(violations) > 20 else ""
        pytest.fail(f"/v1 answers that do not match OpenAI's schema:\n{shown}{more}")


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings: Any) -> None:
    """PBKDF2's million rounds are the point in production and only slowness in tests."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def state_redis_use(url: str) -> None:
    """Point this process's data-plane state at ``url`` (and the stacks it starts after)."""
    os.environ["STATE_REDIS_URL"] = url
    state_use(url)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """A Redis Cluster of three masters with a replica each, for this run (devkit.redis_cluster)."""
    cluster = cluster_start()
    yield cluster
    cluster_stop(cluster)


@pytest.fixture(scope="session", autouse=True)
def _state_on_a_cluster(request: pytest.FixtureRequest) -> Cluster | None:
    """``INFERPLANE_TEST_STATE=cluster`` (make test's cluster group): the data plane's state on
    a real Redis Cluster for the whole run; Celery and Channels stay on ``REDIS_URL``."""
    if os.environ.get("INFERPLANE_TEST_STATE") != "cluster":
        return None
    cluster: Cluster = request.getfixturevalue("redis_cluster")
    state_redis_use(cluster.url)
    return cluster


@pytest.fixture(autouse=True)
def _clean_redis(_state_on_a_cluster: Cluster | None) -> Iterator[None]:
    """Each test starts with an empty Redis database (the tests' own, never make run's)."""
    client = redis_lib.Redis.from_url(settings.REDIS_URL)
    db = settings.REDIS_URL.rstrip("/").rpartition("/")[2]
    assert db.isdigit() and int(db) >= 9, "tests must use a Redis db of their own (9-15)"
    client.flushdb()
    if _state_on_a_cluster is not None:  # each master as it is now (after a failover too)
        for port in _state_on_a_cluster.masters():
            _state_on_a_cluster.client(port).flushdb()
    yield
    client.close()


@dataclass
class TenantPeople:
    """A tenant with one user per role, plus an outsider who belongs to another tenant."""

    tenant: Tenant
    other_tenant: Tenant
    owner: User
    admin: User
    developer: User
    finance: User
    viewer: User
    outsider: User
    staff: User

    def user(self, persona: str) -> User:
        user: User = getattr(self, persona)
        return user


@pytest.fixture
def people(db: None) -> TenantPeople:
    tenant = TenantFactory.create(slug="acme")
    other = TenantFactory.create(slug="globex")
    members = {
        role: MembershipFactory.create(
            tenant=tenant, role=role, user=UserFactory.create(username=role)
        ).user
        for role in Role.values
    }
    outsider = MembershipFactory.create(
        tenant=other, role=Role.OWNER, user=UserFactory.create(username="outsider")
    ).user
    staff = UserFactory.create(username="operator", is_staff=True)
    return TenantPeople(
        tenant=tenant,
        other_tenant=other,
        owner=members["owner"],
        admin=members["admin"],
        developer=members["developer"],
        finance=members["finance"],
        viewer=members["viewer"],
        outsider=outsider,
        staff=staff,
    )


@pytest.fixture
def api() -> APIClient:
    return APIClient()


def streamed(response: Any) -> bytes:
    """A streamed response's body, read the way the ASGI server reads it (its chunks are
    async: a download holds one chunk at a time)."""

    async def read() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    return async_to_sync(read)()


def client_for(user: User) -> APIClient:
    client = APIClient()
    client.force_authenticate(user=user)
    return client


def test_database_url() -> str:
    """The URL of the test database, for processes the tests start (commands, servers)."""
    from django.db import connection

    s = connection.settings_dict
    return f"postgres://{s['USER']}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


test_database_url.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def run_manage(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py`` as a user would, against the test database."""
    full_env = {**os.environ, "DATABASE_URL": test_database_url(), **(env or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
