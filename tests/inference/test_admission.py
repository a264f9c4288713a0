"""Token-weighted fair admission (VTC) on real Redis: the scripts and this process's side,
driven by simulated tenants (no engine: service is instant, so only admission decides)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import pytest

from inference.catalog import pool_prefix
from inference.gateway import admission as admission_module
from inference.gateway import lending
from inference.gateway.admission import (
    DEFAULT_BAND,
    SHARE,
    W_OUT,
    Admission,
    CatalogMissing,
    queue_state,
)
from inference.gateway.admission import scripts as admission_scripts
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
    bands: dict[int, int] | None = None,
) -> Counter[int]:
    """Closed-loop clients: each keeps one request outstanding, resubmitting after
    ``think_seconds``; a request takes ``serve_seconds`` once admitted. ``bands``: a
    tenant's priority band (the default class's when not given)."""
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
                band=(bands or {}).get(tenant, DEFAULT_BAND),
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
    assert await client.llen(BASE + f"q:{DEFAULT_BAND}:2") == 0
    assert await client.zcard(BASE + f"backlog:{DEFAULT_BAND}") == 0
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
    assert await redis_async().llen(BASE + f"q:{DEFAULT_BAND}:2") == 1
    waiting.cancel()  # the client disconnected while queued
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await redis_async().llen(BASE + f"q:{DEFAULT_BAND}:2") == 0
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
    monkeypatch.setattr(admission_scripts, "LEASE_MS", 200)
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
        band=kw.pop("band", DEFAULT_BAND),  # type: ignore[arg-type]
    )


INTERACTIVE, STANDARD, BACKGROUND = range(3)


async def _queued(*rids: str) -> None:
    """Until each request waits in admission (its task ran as far as the queue)."""
    client = redis_async()
    for _ in range(500):
        states = [await client.hget(BASE + "req:" + rid, "state") for rid in rids]
        if all(state == b"queued" for state in states):
            return
        await asyncio.sleep(0.01)  # the poll's interval: the wait is bounded by the loop
    raise AssertionError(f"not all queued: {rids}")


async def test_a_higher_band_is_admitted_before_everything_waiting_below_it() -> None:
    """Strict order: an interactive request arriving behind a queue of background ones is
    admitted at the next free slot, ahead of all of them, whichever tenant sent them."""
    await _pool({"r1": 1})
    adm = Admission()
    await _admit(adm, "running", tenant=1, band=BACKGROUND)
    queued = {
        asyncio.create_task(_admit(adm, f"bg{i}", tenant=1 + i % 2, band=BACKGROUND)): f"bg{i}"
        for i in range(6)
    }
    await _queued(*queued.values())
    standard = asyncio.create_task(_admit(adm, "std", tenant=3, band=STANDARD))
    urgent = asyncio.create_task(_admit(adm, "urgent", tenant=1, band=INTERACTIVE))
    await _queued("std", "urgent")
    await adm.complete(pool=POOL, rid="running", adjustment=0)
    assert await urgent == "r1"
    assert not standard.done() and not any(q.done() for q in queued)
    await adm.complete(pool=POOL, rid="urgent", adjustment=0)
    assert await standard == "r1"
    assert not any(q.done() for q in queued)
    await adm.complete(pool=POOL, rid="std", adjustment=0)
    while queued:  # then the background band, one at a time
        done, _ = await asyncio.wait(queued, return_when=asyncio.FIRST_COMPLETED, timeout=2)
        assert len(done) == 1
        await adm.complete(pool=POOL, rid=queued.pop(done.pop()), adjustment=0)
    assert await redis_async().hgetall(BASE + "rload") == {b"r1": b"0"}


async def test_a_background_flood_leaves_the_top_band_fair_and_nearly_all_the_room() -> None:
    """One tenant floods the background band; two interactive tenants, one sending six
    times as much as the other, share the pool equally between them (token-weighted
    fairness inside the band) and get all of it but the starvation guard's share."""
    await _pool({"r1": 4})
    served = await _simulate(
        Admission(),
        {1: 24, 2: 24, 3: 4},
        {1: 1, 2: 1, 3: 1},
        completions=500,
        bands={1: BACKGROUND, 2: INTERACTIVE, 3: INTERACTIVE},
    )
    top = served[2] + served[3]
    assert served[3] / top == pytest.approx(0.5, abs=0.06)
    assert _share(served, 1) <= 1 / SHARE + 0.03


async def test_a_lower_band_still_progresses_under_a_sustained_flood_at_the_top() -> None:
    """The starvation guard: with the top band always backlogged, each lower band that
    waits still gets one admission in SHARE, and no more than that."""
    await _pool({"r1": 2})
    served = await _simulate(
        Admission(),
        {1: 24, 2: 4, 3: 4},
        {1: 1, 2: 1, 3: 1},
        completions=600,
        bands={1: INTERACTIVE, 2: STANDARD, 3: BACKGROUND},
    )
    for lower in (2, 3):
        assert _share(served, lower) == pytest.approx(1 / SHARE, abs=0.03), served


async def test_no_slot_is_held_for_a_tenant_while_a_higher_band_waits() -> None:
    """A completing request's slot is kept a moment for its tenant when it is owed service
    in its band, but never while a request of a higher band waits: that one takes it."""
    await _pool({"r1": 1})
    adm = Admission()
    await _admit(adm, "bg", tenant=2, band=BACKGROUND)
    other = asyncio.create_task(_admit(adm, "bg-other", tenant=1, band=BACKGROUND))
    urgent = asyncio.create_task(_admit(adm, "urgent", tenant=3, band=INTERACTIVE))
    await _queued("bg-other", "urgent")
    await adm.complete(pool=POOL, rid="bg", adjustment=0)
    assert await redis_async().zcard(BASE + "holds") == 0  # tenant 2 was owed, but no hold
    assert await urgent == "r1"
    assert not other.done()
    await adm.complete(pool=POOL, rid="urgent", adjustment=0)
    assert await other == "r1"


async def test_a_held_slot_is_not_taken_past_a_higher_band_waiting() -> None:
    """A slot kept for a tenant's next request (it was owed service when its last one
    ended) goes to a higher band's request that arrived meanwhile, not to that next one."""
    await _pool({"r1": 1})
    adm = Admission()
    await _admit(adm, "bg", tenant=2, band=BACKGROUND)
    other = asyncio.create_task(_admit(adm, "bg-other", tenant=1, band=BACKGROUND))
    await _queued("bg-other")
    await adm.complete(pool=POOL, rid="bg", adjustment=0)
    assert await redis_async().zcard(BASE + "holds") == 1  # kept for tenant 2
    urgent = asyncio.create_task(_admit(adm, "urgent", tenant=3, band=INTERACTIVE))
    await _queued("urgent")
    back = asyncio.create_task(_admit(adm, "bg-back", tenant=2, band=BACKGROUND))
    assert await urgent == "r1"
    assert not back.done() and not other.done()
    await adm.complete(pool=POOL, rid="urgent", adjustment=0)
    for task in (other, back):
        task.cancel()
    await asyncio.gather(other, back, return_exceptions=True)


async def test_the_queue_state_says_what_waits_in_each_band() -> None:
    """What the operator page and the metrics read: per band and per tenant."""
    await _pool({"r1": 1})
    adm = Admission()
    await _admit(adm, "running", tenant=1)
    waiting = [
        asyncio.create_task(_admit(adm, f"w{i}", tenant=5 + (i >= 2), band=band))
        for i, band in enumerate([INTERACTIVE, INTERACTIVE, BACKGROUND, BACKGROUND, BACKGROUND])
    ]
    await _queued(*(f"w{i}" for i in range(5)))
    state = queue_state(POOL)
    assert state.by_band == {"interactive": 2, "standard": 0, "background": 3}
    assert state.waiting == {5: 2, 6: 3} and state.queued == 5 and state.running == {1: 1}
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_leaving_any_band_frees_its_place() -> None:
    await _pool({"r1": 1})
    adm = Admission()
    await _admit(adm, "running", tenant=1)
    for band in range(3):
        with pytest.raises(ApiError):
            await _admit(adm, f"gone{band}", tenant=2, band=band, wait_seconds=0.2)
    client = redis_async()
    assert [k for k in await client.keys(BASE + "q:*")] == []
    assert [k for k in await client.keys(BASE + "backlog:*")] == []
    await adm.complete(pool=POOL, rid="running", adjustment=0)
    assert await client.hget(BASE + "rload", "r1") == b"0"


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
        assert await client.zcard(BASE + f"backlog:{DEFAULT_BAND}") == 0, steps
        assert not await client.exists(BASE + f"req:cancelled-{steps}"), steps
    # The one slot is free: the next request gets it at once.
    assert await _admit(adm, "after", tenant=3, wait_seconds=0.5) == "r1"


# --- lending an online pool's idle room to batch lines (``Admission.borrow``) ---------------


async def _borrow(adm: Admission, rid: str, tenant: int = 9, sequences: int = 1) -> str:
    return await adm.borrow(
        pool=POOL,
        rid=rid,
        tenant=tenant,
        weight=1,
        prompt_estimate=5,
        prefix="",
        limit_keys=(),
        sequences=sequences,
    )


async def _lends(percent: int) -> None:
    await redis_async().set(BASE + "lend", percent)


async def test_a_pool_lends_only_its_share_and_only_while_it_lends() -> None:
    await _pool({"r1": 4, "r2": 4})
    adm = Admission()
    assert await _borrow(adm, "none") == ""  # a pool lends nothing unless told to
    assert not await adm.lendable(pool=POOL, prefix="")
    await _lends(50)
    # Asking whether it would lend lends nothing (a line waiting elsewhere asks this first).
    assert await adm.lendable(pool=POOL, prefix="") and queue_state(POOL).lent == 0
    got = [await _borrow(adm, f"b{i}") for i in range(5)]
    assert all(got[:4]) and got[4] == ""  # half of 8 sequences, no more
    assert queue_state(POOL).lent == 4
    assert not await adm.lendable(pool=POOL, prefix="")
    await adm.complete(pool=POOL, rid="b0", adjustment=0)
    assert queue_state(POOL).lent == 3
    assert await _borrow(adm, "b5")  # the room given back may be lent again
    assert await _borrow(adm, "big", sequences=2) == ""  # past the share
    await _lends(0)
    await adm.complete(pool=POOL, rid="b1", adjustment=0)
    assert await _borrow(adm, "b6") == ""  # lending turned off: nothing more is lent


async def test_nothing_is_lent_while_an_online_request_waits() -> None:
    await _pool({"r1": 1})
    await _lends(100)
    adm = Admission()
    await _admit(adm, "online", tenant=1)
    waiting = asyncio.create_task(_admit(adm, "waits", tenant=2, band=BACKGROUND))
    await _queued("waits")
    assert await _borrow(adm, "lent") == ""  # even a background request goes first
    await adm.complete(pool=POOL, rid="online", adjustment=0)
    assert await waiting == "r1"


async def test_an_online_request_takes_lent_room_back_at_once() -> None:
    """The pool is full of lent lines: an online request in any band is admitted at once,
    the line lent last is told it lost its room, and its slot never counts twice."""
    await _pool({"r1": 2})
    await _lends(100)
    adm = Admission()
    assert await _borrow(adm, "old") == "r1"
    assert await _borrow(adm, "new") == "r1"
    assert await _admit(adm, "online", tenant=1, band=BACKGROUND, wait_seconds=1) == "r1"
    await asyncio.wait_for(adm.reclaimed["new"].wait(), 5)  # the newest loses its room
    assert not adm.reclaimed["old"].is_set()
    client = redis_async()
    assert await client.hget(BASE + "rload", "r1") == b"2"  # old + online
    assert queue_state(POOL).lent == 1
    # Its replica failing as the room went (a failover racing the reclaim) takes nothing
    # either: the request holds no room (None), which its caller reads as the room lost.
    assert await adm.reroute(pool=POOL, rid="new", failed="r1") is None
    assert await client.hget(BASE + "rload", "r1") == b"2"
    # The revoked line's own settlement afterwards frees nothing that is not its own.
    await adm.complete(pool=POOL, rid="new", adjustment=0)
    assert await client.hget(BASE + "rload", "r1") == b"2"
    assert int(await client.hget(BASE + "lending", "reclaimed") or 0) == 1
    await adm.complete(pool=POOL, rid="old", adjustment=0)
    await adm.complete(pool=POOL, rid="online", adjustment=0)
    assert await client.hget(BASE + "rload", "r1") == b"0"
    assert queue_state(POOL).lent == 0


async def test_lent_room_is_taken_back_only_when_that_makes_room() -> None:
    """A waiting request that would not fit even with the lent room back aborts nothing; once
    it would, the lent request goes."""
    await _pool({"r1": 2})
    await _lends(100)
    adm = Admission()
    assert await _borrow(adm, "lent") == "r1"
    assert await _admit(adm, "online", tenant=1) == "r1"
    big = asyncio.create_task(_admit(adm, "big", tenant=2, sequences=2))
    await _queued("big")
    assert not adm.reclaimed["lent"].is_set()  # 2 sequences would not fit beside "online"
    await adm.complete(pool=POOL, rid="online", adjustment=0)
    assert await big == "r1"
    assert adm.reclaimed["lent"].is_set()
    assert await redis_async().hget(BASE + "rload", "r1") == b"2"


async def test_a_line_waiting_for_its_own_pool_takes_lent_room_that_comes_first() -> None:
    """A batch line waiting in its spot pool's queue leaves it for room the online pool lends
    first (``lending.queue_or_borrow``), and is then in one pool only; a spot slot that comes
    first is kept, and nothing is lent; a line cancelled while it waits holds nothing."""
    await _pool({"r1": 1})
    await _lends(100)
    spot = pool_prefix("sim-spot")
    client = redis_async()
    await client.hset(spot + "replicas", "s1", 1)
    await client.set(spot + "policy", "vtc")
    adm = Admission()

    def line(rid: str) -> Coroutine[Any, Any, tuple[str, bool]]:
        async def admit() -> str:
            return await adm.admit(
                pool="sim-spot",
                rid=rid,
                tenant=9,
                weight=1,
                prompt_estimate=5,
                prefix="",
                wait_seconds=30,
                limit_keys=(),
            )

        async def lendable() -> bool:
            return await adm.lendable(pool=POOL, prefix="")

        async def give_back() -> None:
            await adm.complete(pool="sim-spot", rid=rid, adjustment=0)

        return lending.queue_or_borrow(
            admit,
            lambda: _borrow(adm, rid),
            lendable,
            give_back,
            deadline=time.monotonic() + 30,
            may_ask=lambda: True,
        )

    async def queued_in_spot(rid: str) -> None:
        for _ in range(500):
            if await client.hget(spot + "req:" + rid, "state") == b"queued":
                return
            await asyncio.sleep(0.01)  # the poll's interval: the wait is bounded by the loop
        raise AssertionError(f"{rid} not queued")

    assert await _admit(adm, "online", tenant=1) == "r1"  # the online pool busy online
    assert await line("first") == ("s1", False)  # the spot pool full from now on
    waiting = asyncio.create_task(line("line"))
    await queued_in_spot("line")
    await adm.complete(pool=POOL, rid="online", adjustment=0)  # the online pool goes idle
    assert await waiting == ("r1", True)
    assert queue_state(POOL).lent == 1
    assert not await client.exists(spot + "req:line")  # out of the spot queue
    assert await client.zcard(spot + "inflight") == 1  # "first" alone holds the spot slot
    # A line cancelled while it waits (its batch was cancelled) leaves the queue.
    gone = asyncio.create_task(line("gone"))
    await queued_in_spot("gone")
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert not await client.exists(spot + "req:gone")
    # The other way round: the spot slot frees first, and it is kept.
    other = asyncio.create_task(line("other"))
    await queued_in_spot("other")
    await adm.complete(pool="sim-spot", rid="first", adjustment=0)
    assert await other == ("s1", False)
    assert queue_state(POOL).lent == 1
