from __future__ import annotations

import pytest

from inference.models import Pool
from inference.services import model_ensure, pool_ensure
from tests.conftest import run_manage

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def pool() -> Pool:
    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    return pool_ensure(name="online", kind="dedicated", model=model, replica_urls=[])


def test_configure_pool(pool: Pool) -> None:
    result = run_manage("configure_pool", "online", "--max-inflight", "3", "--policy", "fcfs")
    assert result.returncode == 0, result.stderr
    assert "max_inflight=3 policy=fcfs" in result.stdout
    pool.refresh_from_db()
    assert (pool.max_inflight, pool.policy) == (3, "fcfs")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope"], "no pool named 'nope'"),
        (["online", "--policy", "lottery"], "--policy must be one of vtc, fcfs"),
        (["online", "--max-inflight", "0"], "--max-inflight must be between 1 and 4096, not 0"),
        (
            ["online", "--max-queue-wait", "soon"],
            "--max-queue-wait must be a whole number, not 'soon'",
        ),
    ],
)
def test_configure_pool_bad_input(pool: Pool, args: list[str], message: str) -> None:
    result = run_manage("configure_pool", *args)
    assert result.returncode != 0
    assert result.stderr.strip() == f"CommandError: {message}"
    pool.refresh_from_db()
    assert (pool.max_inflight, pool.policy) == (8, "vtc")
