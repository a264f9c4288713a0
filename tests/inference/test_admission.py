"""Token-weighted fair admission (VTC) on real Redis: the scripts and this process's side,
driven by simulated tenants (no engine: service is instant, so only admission decides)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest

from inference.catalog import pool_prefix
from inference.gateway import admission as admission_module
from inference.gateway.admission import W_OUT, Admission, CatalogMissing
from inference.gateway.errors import ApiError
from inference.gateway.redis import redis_async

POOL = "sim"
BASE = pool_prefix(POOL)
PROMPT, OUTPUT = 10, 20
COST = PROMPT + 2 * OUTPUT  # weighted service of one request


async def _pool(replicas: dict[str, int], policy: str = "vtc") -> None:
    client = redis_async()
    await client.delete(BASE + "replicas")
    for replica, capacity in replicas.items():
        await client.hset(BASE + "replicas", replica, capacity)
    await client.set(BASE + "policy", policy)


async def _simulate(
    adm: Admission,
    outstanding: dict[int, int],
    weights: dict[int, int],
    completions: int,
    service: Counter[int] | None = None,
    serve_seconds: float = 0,
    think_seconds: float = 0,
) -> Counter[int]:
    """Closed-loop clients: each keeps one request outstanding, resubmitting after
    ``think_seconds``; a request takes ``serve_seconds`` once admitted."""
    served: Counter[int] = service if service is not None else Counter()
    done = 0

    async def client(tenant: int) -> None:
        nonlocal done
        while done < completions:
            rid = uuid.uuid4().hex
            await adm.admit(
                pool=POOL,
                rid=rid,
                tenant=tenant,
                weight=weights[tenant],
                prompt_estimate=PROMPT,
                prefix="",
                wait_seconds=30,
                limit_keys=(),
            )
            await asyncio.sleep(serve_seconds)
            await adm.complete(pool=POOL, rid=rid, adjustment=W_OUT * OUTPUT)
            if done < completions:
                served[tenant] += COST
                done += 1
            await asyncio.sleep(think_seconds)

    await asyncio.gather(*(client(t) for t, n in outstanding.items() for _ in range(n)))
    return served


def _share(served: Counter[int], tenant: int) -> float:
    return served[tenant] / sum(served.values())


async def test_vtc_shares_equally_between_unequal_demands() -> None:
    await _pool({"r1": 4})
    served = await _simulate(Admission(), {1: 24, 2: 4}, {1: 1, 2: 1}, completions=400)
    assert _share(served, 2) == pytest.approx(0.5, abs=0.05)


async def test_clients_that_take_a_moment_to_resubmit_keep_their_share() -> None:
    """Real clients need a few milliseconds between the end of one answer and the next
    request; the slot is held for the tenant that is owed service meanwhile."""
    await _pool({"r1": 4})
    served = await _simulate(
        Admission(),
        {1: 24, 2: 4},
        {1: 1, 2: 1},
        completions=300,
        serve_seconds=0.02,
        think_seconds=0.005,
    )
    assert _share(served, 2) == pytest.approx(0.5, abs=0.06)


async def test_a_held_slot_goes_to_others_when_its_tenant_does_not_return() -> None:
    await _pool({"r1": 1})
    adm = Admission()
    await adm.admit(
        pool=POOL,
        rid="b1",
        tenant=2,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=5,
        limit_keys=(),
    )
    flood = asyncio.create_task(
        adm.admit(
            pool=POOL,
            rid="a1",
            tenant=1,
            weight=1,
            prompt_estimate=5000,
            prefix="",
            wait_seconds=5,
            limit_keys=(),
        )
    )
    await asyncio.sleep(0.05)
    await adm.complete(pool=POOL, rid="b1", adjustment=0)  # tenant 2 is owed: slot held
    assert await redis_async().zcard(BASE + "holds") == 1
    started = asyncio.get_running_loop().time()
    assert await flood == "r1"  # ... until the hold expires
    waited = asyncio.get_running_loop().time() - started
    assert admission_module.HOLD_MS / 1000 * 0.8 <= waited < 2
    assert await redis_async().zcard(BASE + "holds") == 0


async def test_vtc_is_global_across_processes() -> None:
    """Two web processes (two Admission instances, each with its own grant listener) share
    one pool: tenant A's flood arrives through one, tenant B through the other."""
    await _pool({"r1": 4})
    served: Counter[int] = Counter()
    weights = {1: 1, 2: 1}
    runs = [
        asyncio.create_task(_simulate(Admission(), {1: 24}, weights, 10**6, service=served)),
        asyncio.create_task(_simulate(Admission(), {2: 4}, weights, 10**6, service=served)),
    ]
    while sum(served.values()) < 400 * COST:  # noqa: ASYNC110 - polling a plain counter
        await asyncio.sleep(0.01)
    snapshot = Counter(served)
    for run in runs:
        run.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    assert _share(snapshot, 2) == pytest.approx(0.5, abs=0.05)


async def test_vtc_honours_weights() -> None:
    await _pool({"r1": 4})
    served = await _simulate(Admission(), {1: 24, 2: 4}, {1: 1, 2: 2}, completions=450)
    assert _share(served, 2) == pytest.approx(2 / 3, abs=0.05)


async def test_fcfs_favours_whoever_sends_more() -> None:
    await _pool({"r1": 4}, policy="fcfs")
    served = await _simulate(Admission(), {1: 24, 2: 4}, {1: 1, 2: 1}, completions=400)
    assert _share(served, 2) < 0.25  # about 4/28: the flood wins


async def test_idle_tenant_earns_no_credit() -> None:
    """A tenant arriving after others were served starts level with them, not far behind
    (it would otherwise take every slot until its counter caught up)."""
    await _pool({"r1": 2})
    adm = Admission()
    weights = {1: 1, 2: 1, 3: 1}
    await _simulate(adm, {1: 6, 2: 6}, weights, completions=300)
    served = await _simulate(adm, {1: 6, 2: 6, 3: 6}, weights, completions=150)
    assert _share(served, 3) == pytest.approx(1 / 3, abs=0.08)


async def test_queue_wait_is_bounded_and_leaves_no_trace() -> None:
    await _pool({"r1": 1})
    adm = Admission()
    held = await adm.admit(
        pool=POOL,
        rid="holder",
        tenant=1,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=5,
        limit_keys=(),
    )
    assert held == "r1"
    with pytest.raises(ApiError) as err:
        await adm.admit(
            pool=POOL,
            rid="waiter",
            tenant=2,
            weight=1,
            prompt_estimate=5,
            prefix="",
            wait_seconds=0.3,
            limit_keys=(),
        )
    assert err.value.status == 503 and "retry-after" in err.value.headers
    client = redis_async()
    assert await client.llen(BASE + "q:2") == 0
    assert await client.zcard(BASE + "backlog") == 0
    assert not await client.exists(BASE + "req:waiter")


async def test_a_client_that_leaves_the_queue_frees_its_place() -> None:
    await _pool({"r1": 1})
    adm = Admission()
    await adm.admit(
        pool=POOL,
        rid="a",
        tenant=1,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=5,
        limit_keys=(),
    )
    waiting = asyncio.create_task(
        adm.admit(
            pool=POOL,
            rid="b",
            tenant=2,
            weight=1,
            prompt_estimate=5,
            prefix="",
            wait_seconds=5,
            limit_keys=(),
        )
    )
    await asyncio.sleep(0.1)
    assert await redis_async().llen(BASE + "q:2") == 1
    waiting.cancel()  # the client disconnected while queued
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await redis_async().llen(BASE + "q:2") == 0
    await adm.complete(pool=POOL, rid="a", adjustment=0)
    # The slot goes to the next real request, not to the one that left.
    got = await adm.admit(
        pool=POOL,
        rid="c",
        tenant=3,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=1,
        limit_keys=(),
    )
    assert got == "r1"


async def test_leases_of_a_crashed_process_are_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission_module, "LEASE_MS", 200)
    await _pool({"r1": 1})
    crashed = Admission()
    await crashed.admit(
        pool=POOL,
        rid="lost",
        tenant=1,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=1,
        limit_keys=(),
    )
    crashed.held.clear()  # the process died: nobody renews or completes
    await asyncio.sleep(0.3)
    survivor = Admission()
    got = await survivor.admit(
        pool=POOL,
        rid="next",
        tenant=2,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=1,
        limit_keys=(),
    )
    assert got == "r1"
    assert int(await redis_async().hget(BASE + "rload", "r1") or 0) == 1


async def test_least_loaded_routing_with_prefix_affinity() -> None:
    await _pool({"r1": 8, "r2": 8})
    adm = Admission()
    same = [
        await adm.admit(
            pool=POOL,
            rid=f"s{i}",
            tenant=1,
            weight=1,
            prompt_estimate=5,
            prefix="system-prompt-hash",
            wait_seconds=1,
            limit_keys=(),
        )
        for i in range(2)
    ]
    assert same[0] == same[1]  # near-least-loaded (slack 1): the prefix picks the replica
    loads = Counter(
        [
            await adm.admit(
                pool=POOL,
                rid=f"u{i}",
                tenant=1,
                weight=1,
                prompt_estimate=5,
                prefix="",
                wait_seconds=1,
                limit_keys=(),
            )
            for i in range(10)
        ]
    )
    total = Counter(same) + loads
    assert total["r1"] == total["r2"] == 6  # without a prefix: least in-flight


async def test_reroute_takes_a_failed_replica_out_and_moves_the_request() -> None:
    await _pool({"r1": 1, "r2": 1})
    adm = Admission()
    first = await adm.admit(
        pool=POOL,
        rid="x",
        tenant=1,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=1,
        limit_keys=(),
    )
    other = "r2" if first == "r1" else "r1"
    assert await adm.reroute(pool=POOL, rid="x", failed=first) == other
    assert await redis_async().hkeys(BASE + "replicas") == [other.encode()]
    # The last replica is not taken out on one failure (a slow connect under load is not a
    # dead engine): the request keeps its slot and retries it; the health probe decides.
    assert await adm.reroute(pool=POOL, rid="x", failed=other) == other
    assert await redis_async().hkeys(BASE + "replicas") == [other.encode()]
    assert await redis_async().zcard(BASE + "inflight") == 1


async def test_reroute_releases_the_slot_when_the_others_are_full() -> None:
    await _pool({"r1": 1, "r2": 1})
    adm = Admission()
    a = await adm.admit(
        pool=POOL,
        rid="a",
        tenant=1,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=1,
        limit_keys=(),
    )
    await adm.admit(
        pool=POOL,
        rid="b",
        tenant=1,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=1,
        limit_keys=(),
    )
    assert await adm.reroute(pool=POOL, rid="a", failed=a) == ""
    assert await redis_async().zcard(BASE + "inflight") == 1


async def test_a_flushed_redis_is_reported_for_republishing() -> None:
    await redis_async().delete(BASE + "replicas")
    with pytest.raises(CatalogMissing):
        await Admission().admit(
            pool=POOL,
            rid="y",
            tenant=1,
            weight=1,
            prompt_estimate=5,
            prefix="",
            wait_seconds=1,
            limit_keys=(),
        )


async def _admit(adm: Admission, rid: str, tenant: int, sequences: int = 1, **kw: object) -> str:
    return await adm.admit(
        pool=POOL,
        rid=rid,
        tenant=tenant,
        weight=1,
        prompt_estimate=5,
        prefix="",
        wait_seconds=kw.pop("wait_seconds", 5),  # type: ignore[arg-type]
        limit_keys=(),
        sequences=sequences,
    )


async def test_a_request_takes_as_many_slots_as_it_runs_sequences() -> None:
    """Eight prompts (or n=8) are eight sequences in the engine: they fill a replica of
    eight, and the next tenant's one-token request waits for room instead of queueing inside
    the engine behind them."""
    await _pool({"r1": 8})
    adm = Admission()
    assert await _admit(adm, "big", tenant=1, sequences=8) == "r1"
    assert await redis_async().hget(BASE + "rload", "r1") == b"8"
    small = asyncio.create_task(_admit(adm, "small", tenant=2))
    await asyncio.sleep(0.3)
    assert not small.done()  # no room: it waits in admission, not in the engine
    await adm.complete(pool=POOL, rid="big", adjustment=0)
    assert await small == "r1"
    assert await redis_async().hget(BASE + "rload", "r1") == b"1"
    await adm.complete(pool=POOL, rid="small", adjustment=0)
    assert await redis_async().hget(BASE + "rload", "r1") == b"0"


async def test_a_large_request_lets_small_ones_past_only_for_a_moment() -> None:
    """When the tenant owed service next wants more room than is free, requests of the next
    tenants that fit may go past it for BACKFILL_MS (a large request does not stop everyone
    at once); after that nobody passes it, so its room frees up (it is never starved)."""
    await _pool({"r1": 4})
    adm = Admission()
    for i in range(3):
        await _admit(adm, f"a{i}", tenant=1)
    big = asyncio.create_task(_admit(adm, "big", tenant=2, sequences=4))
    await asyncio.sleep(0.1)
    assert await _admit(adm, "early", tenant=3) == "r1"  # fits the free slot: goes past
    assert not big.done()
    await asyncio.sleep(admission_module.BACKFILL_MS / 1000 + 0.2)
    await adm.complete(pool=POOL, rid="a0", adjustment=0)
    late = asyncio.create_task(_admit(adm, "late", tenant=4))
    await asyncio.sleep(0.3)
    assert not late.done()  # a slot is free, but big has waited long enough: nobody passes
    for rid in ("a1", "a2", "early"):
        await adm.complete(pool=POOL, rid=rid, adjustment=0)
    assert await big == "r1"
    await asyncio.sleep(0.2)
    assert not late.done()  # big holds all four
    await adm.complete(pool=POOL, rid="big", adjustment=0)
    assert await late == "r1"


async def test_a_held_slot_is_taken_only_by_a_request_that_fits() -> None:
    await _pool({"r1": 4})
    adm = Admission()
    await _admit(adm, "t2", tenant=2)
    waiting = asyncio.create_task(_admit(adm, "t1", tenant=1, sequences=4))
    await asyncio.sleep(0.05)
    await adm.complete(pool=POOL, rid="t2", adjustment=0)  # tenant 2 is owed: slot held
    assert await redis_async().zcard(BASE + "holds") == 1
    # Tenant 2 comes back with a request of three sequences: one held slot is not enough,
    # so the hold is let go and it queues (behind tenant 1's request of four).
    back = asyncio.create_task(_admit(adm, "t2b", tenant=2, sequences=3))
    assert await waiting == "r1"
    await asyncio.sleep(0.1)
    assert not back.done()
    assert await redis_async().hget(BASE + "rload", "r1") == b"4"
    await adm.complete(pool=POOL, rid="t1", adjustment=0)
    assert await back == "r1"
    assert await redis_async().hget(BASE + "rload", "r1") == b"3"


async def test_an_admit_cancelled_at_any_moment_leaves_no_slot_taken() -> None:
    """A caller cancelled while its request is on the way to Redis (a guard check out of its
    budget, a client gone) leaves nothing behind, whatever the script did meanwhile: granted,
    queued or not run. Before, a grant whose answer the cancel dropped held the slot for
    nobody until its lease ran out (20 s, for every tenant of the pool)."""
    await _pool({"r1": 1})
    adm = Admission()
    client = redis_async()
    for steps in range(40):  # every point of the round trip, one event-loop step at a time
        attempt = asyncio.create_task(_admit(adm, f"cancelled-{steps}", tenant=1 + steps % 2))
        for _ in range(steps):
            await asyncio.sleep(0)
        attempt.cancel()
        try:
            got = await attempt
        except asyncio.CancelledError:
            pass
        else:  # it was granted before the cancel: its caller holds it, and gives it back
            assert got == "r1"
            await adm.complete(pool=POOL, rid=f"cancelled-{steps}", adjustment=0)
        assert await client.zcard(BASE + "inflight") == 0, steps
        assert await client.zcard(BASE + "backlog") == 0, steps
        assert not await client.exists(BASE + f"req:cancelled-{steps}"), steps
    # The one slot is free: the next request gets it at once.
    assert await _admit(adm, "after", tenant=3, wait_seconds=0.5) == "r1"
