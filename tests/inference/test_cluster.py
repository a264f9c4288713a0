"""The data plane's state on a real Redis Cluster (``make test``'s cluster group starts one:
devkit/redis_cluster.py): one slot per script, the keys' last use flushed from every tenant's
slot, and a master killed in the middle of work — its replica takes over and the same
clients carry on by themselves."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable

import pytest
from asgiref.sync import sync_to_async
from redis.exceptions import RedisError

from controlplane.redis import redis_sync
from devkit.redis_cluster import Cluster
from inference.catalog import pool_prefix
from inference.gateway import limits
from inference.gateway import redis as gateway_redis
from inference.gateway.admission import Admission
from inference.gateway.auth import KeyInfo
from inference.gateway.errors import ApiError
from inference.gateway.lua import Batch
from inference.gateway.redis import redis_async
from tenants.keys import last_used_key, last_used_tenants_key
from tenants.models import ApiKey
from tenants.services import api_keys_last_used_flush
from tests.inference.test_limits import _key

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        os.environ.get("INFERPLANE_TEST_STATE") != "cluster",
        reason="make test's cluster group runs these (INFERPLANE_TEST_STATE=cluster)",
    ),
]

POOL = "clustered"


def _slot(key: str) -> int:
    return int(redis_sync().execute_command("CLUSTER", "KEYSLOT", key))  # type: ignore[no-untyped-call]


async def test_a_tenants_limits_live_in_its_slot_and_its_keys_last_use_is_flushed() -> None:
    key = await sync_to_async(_key)(rpm=2)
    t, k = limits._scopes(key, limits._month())
    slots = {_slot(name) for name in [*t.values(), *k.values(), last_used_key(key.tenant_id)]}
    assert len(slots) == 1  # ACQUIRE and RELEASE touch one node
    # The rate limit holds on the cluster: two pass, the third is refused.
    grants = [await limits.acquire(key, rid=uuid.uuid4().hex, estimate=10) for _ in range(2)]
    with pytest.raises(ApiError) as refused:
        await limits.acquire(key, rid=uuid.uuid4().hex, estimate=10)
    assert refused.value.status == 429
    # Their ends name the tenant to the last-use flush (a set in a slot of its own), in the
    # same round trip as the rest of each end.
    batch = Batch()
    for grant in grants:
        grant.release_into(batch, 5)
    await batch.execute()
    named = await redis_async().smembers(last_used_tenants_key(key.tenant_id))
    assert named == {str(key.tenant_id).encode()}
    assert await sync_to_async(api_keys_last_used_flush)() == 1
    used = await ApiKey.objects.aget(prefix=key.prefix)
    assert used.last_used_at is not None
    assert await redis_async().exists(last_used_key(key.tenant_id)) == 0


async def _pool(replicas: dict[str, int]) -> None:
    client = redis_async()
    for replica, capacity in replicas.items():
        await client.hset(pool_prefix(POOL) + "replicas", replica, capacity)
    await client.set(pool_prefix(POOL) + "policy", "vtc")


async def _one_request(adm: Admission, key: KeyInfo) -> None:
    """A request's Redis work as the gateway does it: limits, admission, then its end
    (slot and limits given back in one round trip)."""
    rid = uuid.uuid4().hex
    grant = await limits.acquire(key, rid=rid, estimate=10)
    try:
        await adm.admit(
            pool=POOL,
            rid=rid,
            tenant=key.tenant_id,
            weight=1,
            prompt_estimate=5,
            prefix="",
            wait_seconds=5,
            limit_keys=grant.conc_keys,
            limit_member=grant.member,
        )
    except BaseException:
        await grant.release(0)
        raise
    batch = Batch()
    adm.complete_into(batch, pool=POOL, rid=rid, adjustment=0)
    grant.release_into(batch, 5)
    await batch.execute()


async def _served(
    progress: asyncio.Event, enough: Callable[[], bool], why: Callable[[], str] = str
) -> None:
    try:
        async with asyncio.timeout(30):  # only a hang reaches it
            while not enough():
                progress.clear()
                await progress.wait()
    except TimeoutError:
        raise AssertionError(f"no work: {why()}") from None


async def test_a_master_killed_mid_work_its_replica_takes_over_and_work_goes_on(
    redis_cluster: Cluster,
) -> None:
    key = await sync_to_async(_key)(max_concurrency=4)
    await _pool({"r1": 4})
    adm = Admission()
    served = errors = 0
    stop = asyncio.Event()
    progress = asyncio.Event()  # set at each request served

    async def client() -> None:
        nonlocal served, errors
        while not stop.is_set():
            try:
                await _one_request(adm, key)
                served += 1
                progress.set()
            except Exception:  # the gateway answers these 503: the client retries
                errors += 1
                await asyncio.sleep(0.05)  # a client's back-off before it retries

    workers = [asyncio.create_task(client()) for _ in range(4)]
    try:
        await _served(progress, lambda: served >= 20)  # work flows before the fault
        # The master holding both the pool's and the tenant's slots... or either: kill the
        # one that holds the tenant's limits, the hotter of the two.
        dead = redis_cluster.master_of(limits._scopes(key, limits._month())[0]["rpm"])
        redis_cluster.kill(dead)
        promoted = await asyncio.to_thread(redis_cluster.wait_promoted, dead)
        assert promoted != dead
        after = served
        # The same clients carry on, with no restart of ours.
        await _served(progress, lambda: served >= after + 20, why=lambda: f"{errors} errors")
    finally:
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
        # The killed node comes back as a replica of its old slots' new owner.
        await asyncio.to_thread(redis_cluster.start_node, dead)
        await asyncio.to_thread(redis_cluster.wait_ok)
    # Every request served gave its lease back; one that failed while its node was away may
    # leave its own, which ends with its lease (limits.LEASE_MS) like a crashed process's.
    held = await redis_async().zcard(limits._scopes(key, limits._month())[0]["conc"])
    assert held <= errors


async def test_a_new_client_takes_many_batches_at_once() -> None:
    """A web process's first requests arrive together on a client that does not know the
    cluster yet (each test's event loop has a new one): every batch runs, none meets the
    seed connection being closed under it (redis-py 8.1; ``inference.gateway.redis``)."""
    key = await sync_to_async(_key)()
    grants = [await limits.acquire(key, rid=uuid.uuid4().hex, estimate=10) for _ in range(80)]
    gateway_redis._shared.clear()  # the next command makes a new client, as a new process
    batches = []
    for grant in grants:
        batch = Batch()
        grant.release_into(batch, 5)
        batches.append(batch.execute())
    results = await asyncio.gather(*batches, return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []


def _key_on_another_master(cluster: Cluster, than: int) -> str:
    """A key (of this test's own) that a master other than ``than`` holds."""
    for n in range(1000):
        name = f"ip:test:{{elsewhere-{n}}}"
        if cluster.master_of(name) != than:
            return name
    raise LookupError(than)


async def test_a_requests_end_that_meets_a_dead_node_runs_nothing_twice(
    redis_cluster: Cluster,
) -> None:
    """A request's end is one pipeline over several nodes, and one of them is dead: what ran
    on the live nodes ran once, and the failure reaches the caller, whose fallback takes over
    (settle: the record straight to Postgres). redis-py's own cluster pipeline retried, and
    sent again each command whose answer it lacked or that answered empty: RELEASE ("no
    notices") added the request's tokens to its tenant's month four times
    (``inference.gateway.redis._SentOnce``). Other requests' commands on live nodes, beside
    it and after it, all run."""
    key = await sync_to_async(_key)(monthly_token_budget=1_000_000)
    counter = limits._scopes(key, limits._month())[0]["month"]
    tenants_master = redis_cluster.master_of(counter)
    elsewhere = _key_on_another_master(redis_cluster, tenants_master)
    dead = redis_cluster.master_of(elsewhere)
    first, second = [await limits.acquire(key, rid=uuid.uuid4().hex, estimate=10) for _ in range(2)]
    before = int(await redis_async().get(counter) or 0)
    batch = Batch()
    first.release_into(batch, 400)
    await batch.execute()
    once = int(await redis_async().get(counter) or 0) - before
    live = next(  # a key of this test's own on a live master (the tenant's)
        f"ip:test:{{live-{n}}}"
        for n in range(1000)
        if redis_cluster.master_of(f"ip:test:{{live-{n}}}") == tenants_master
    )
    redis_cluster.kill(dead)
    try:
        batch = Batch()
        second.release_into(batch, 400)
        batch.xadd(elsewhere, {"f": "v"})  # on the dead node: this end's round trip fails
        # Other requests' commands on live nodes, in flight beside it and sent after it
        # (the client then learns the cluster again): none of them is cut.
        beside = [redis_async().incr(live) for _ in range(40)]
        results = await asyncio.gather(batch.execute(), *beside, return_exceptions=True)
        assert isinstance(results[0], RedisError)
        assert [r for r in results[1:] if isinstance(r, BaseException)] == []
        await asyncio.to_thread(redis_cluster.wait_promoted, dead)
        after = await asyncio.gather(*[redis_async().incr(live) for _ in range(40)])
        assert max(after) == 80
    finally:
        await asyncio.to_thread(redis_cluster.start_node, dead)
        await asyncio.to_thread(redis_cluster.wait_ok)
    assert int(await redis_async().get(counter) or 0) - before == 2 * once
