from __future__ import annotations

import orjson
import pytest

from controlplane.redis import redis_sync
from fleet.models import Pool, Replica
from inference.catalog import CATALOG_KEY, pool_prefix
from inference.services import model_ensure, pool_ensure, replica_add
from tests.conftest import run_manage
from tests.engines import free_port

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


def test_configure_pool_lends_an_online_pool_s_idle_room_and_never_a_spot_pool_s(
    pool: Pool,
) -> None:
    result = run_manage("configure_pool", "online", "--lend-percent", "40")
    assert result.returncode == 0, result.stderr
    assert "lend_percent=40" in result.stdout
    assert redis_sync().get(pool_prefix("online") + "lend") == b"40"  # admission's copy
    assert run_manage("configure_pool", "online", "--lend-percent", "0").returncode == 0
    assert redis_sync().get(pool_prefix("online") + "lend") == b"0"
    over = run_manage("configure_pool", "online", "--lend-percent", "101")
    assert over.stderr.strip() == "CommandError: --lend-percent must be between 0 and 100, not 101"
    pool_ensure(name="spot", kind="spot", model=pool.model, replica_urls=[])
    spot = run_manage("configure_pool", "spot", "--lend-percent", "10")
    assert spot.returncode != 0
    assert spot.stderr.strip() == (
        "CommandError: lend_percent: Only an online (dedicated) pool lends room to batch lines."
    )
    assert Pool.objects.get(name="spot").lend_percent == 0


# --- configure_pool --discovery ---------------------------------------------------------------


def test_configure_pool_discovery(pool: Pool) -> None:
    url = "http://vllm-online.inferplane.svc.cluster.local:8000"
    result = run_manage("configure_pool", "online", "--discovery", url, "--drain-grace", "120")
    assert result.returncode == 0, result.stderr
    assert f"discovery={url}" in result.stdout
    pool.refresh_from_db()
    assert (pool.discovery, pool.dns_name, pool.dns_port, pool.drain_grace_seconds) == (
        "dns",
        "vllm-online.inferplane.svc.cluster.local",
        8000,
        120,
    )
    result = run_manage("configure_pool", "online", "--discovery", "static")
    assert result.returncode == 0, result.stderr
    pool.refresh_from_db()
    assert pool.discovery == "static"


@pytest.mark.parametrize("value", ["dns", "vllm-online:8000", "http://bad_name:8000/x"])
def test_configure_pool_bad_discovery(pool: Pool, value: str) -> None:
    result = run_manage("configure_pool", "online", "--discovery", value)
    assert result.returncode != 0
    assert result.stderr.strip() == (
        "CommandError: discovery: use 'static' or http(s)://SERVICE-NAME:PORT (e.g. "
        f"http://vllm-online.inferplane.svc.cluster.local:8000), not {value!r}"
    )
    pool.refresh_from_db()
    assert pool.discovery == "static"


# --- replica ----------------------------------------------------------------------------------


def test_replica_add_list_drain_ready_remove(pool: Pool) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = run_manage("replica", "add", "online", url + "/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"online-1 {url}: added to pool online (down until its first probe says it is ready)"
    )
    replica = Replica.objects.get(pool=pool)
    assert (replica.name, replica.url, replica.state) == ("online-1", url, "down")
    raw = redis_sync().get(CATALOG_KEY)
    assert raw is not None
    catalog = orjson.loads(raw)
    assert catalog["pools"]["online"]["replicas"][str(replica.pk)]["name"] == "online-1"

    result = run_manage("replica", "add", "online", "http://gpu-b:8000", "--name", "gpu-b")
    assert result.returncode == 0, result.stderr
    assert Replica.objects.get(url="http://gpu-b:8000").name == "gpu-b"

    result = run_manage("replica", "list", "online")
    assert result.returncode == 0, result.stderr
    assert f"online-1\t{url}\tdown\t0 in flight" in result.stdout

    result = run_manage("replica", "drain", url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"online-1 {url}: draining (no new requests)"
    replica.refresh_from_db()
    assert replica.state == "draining"

    result = run_manage("replica", "ready", "online-1")  # by name; probed: nobody listens
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"online-1 {url}: down (ConnectError")
    replica.refresh_from_db()
    assert replica.state == "down"

    result = run_manage("replica", "remove", url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"online-1 {url}: removed"
    assert list(Replica.objects.values_list("name", flat=True)) == ["gpu-b"]


def test_replica_remove_with_requests_in_flight_needs_force(pool: Pool) -> None:
    assert run_manage("replica", "add", "online", "http://gpu-a:8000").returncode == 0
    replica = Replica.objects.get()
    redis_sync().hset(pool_prefix("online") + "rload", str(replica.pk), 2)
    result = run_manage("replica", "remove", "http://gpu-a:8000")
    assert result.returncode != 0
    assert result.stderr.strip() == (
        "CommandError: replica: 2 request(s) in flight on online-1: drain it first and wait, "
        "or force"
    )
    assert Replica.objects.filter(pk=replica.pk).exists()
    result = run_manage("replica", "remove", "http://gpu-a:8000", "--force")
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip() == "online-1 http://gpu-a:8000: removed with 2 request(s) in flight"
    )
    assert not Replica.objects.exists()
    assert redis_sync().hget(pool_prefix("online") + "rload", str(replica.pk)) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["add", "nope", "http://gpu-a:8000"], "no pool named 'nope'"),
        (
            ["add", "online", "gpu-a:8000"],
            "url: 'gpu-a:8000' is not an engine URL like http://10.0.0.5:8000",
        ),
        (
            ["add", "online", "ftp://gpu-a"],
            "url: 'ftp://gpu-a' is not an engine URL like http://10.0.0.5:8000",
        ),
        (
            ["add", "online", "http://gpu-a:8000"],
            "url: http://gpu-a:8000 is already a replica of pool online",
        ),
        (
            ["add", "online", "http://gpu-c:8000", "--name", "online-1"],
            "name: pool online already has a replica named online-1",
        ),
        (["drain", "http://gpu-z:8000"], "no replica 'http://gpu-z:8000'"),
        (["remove", "online-9"], "no replica 'online-9'"),
        (["ready", "online-1", "--pool", "nope"], "no pool named 'nope'"),
        (
            ["drain", "http://gpu-a:8000", "--pool", "batch"],
            "no replica 'http://gpu-a:8000' in pool 'batch'",
        ),
        (
            ["drain", "http://shared:8000"],
            "several pools have a replica 'http://shared:8000': add --pool",
        ),
    ],
)
def test_replica_bad_input(pool: Pool, args: list[str], message: str) -> None:
    replica_add(pool=pool, url="http://gpu-a:8000")
    replica_add(pool=pool, url="http://shared:8000")
    batch = pool_ensure(name="batch", kind="spot", model=pool.model, replica_urls=[])
    replica_add(pool=batch, url="http://shared:8000")
    before = sorted(Replica.objects.values_list("pool__name", "name", "url", "state"))
    result = run_manage("replica", *args)
    assert result.returncode != 0
    assert result.stderr.strip() == f"CommandError: {message}"
    assert sorted(Replica.objects.values_list("pool__name", "name", "url", "state")) == before


def test_replica_without_a_subcommand_says_which() -> None:
    result = run_manage("replica")
    assert result.returncode != 0
    assert "add|drain|ready|remove|list" in result.stderr
