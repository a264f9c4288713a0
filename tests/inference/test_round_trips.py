"""What a request costs Redis in round trips, counted on the gateway's own client: a request
admitted at once takes its limits and its place in one round trip (ACQUIRE beside ENQUEUE),
and gives back its slot and limits, spools its usage record and names its tenant to the
last-use flush in one more. Driven in-process through ``Lifecycle``, against the session's
real vLLM engine, real Redis and Postgres."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest

from inference.catalog import catalog_publish
from inference.gateway import admission as admission_module
from inference.gateway import limits
from inference.gateway.admission import queue_state
from inference.gateway.admission import scripts as admission_scripts
from inference.gateway.admission.scripts import PROGRESS, TICK
from inference.gateway.auth import KeyInfo, key_info_from_db
from inference.gateway.errors import ApiError
from inference.gateway.lifecycle import Lifecycle
from inference.gateway.redis import redis_async
from inference.gateway.upstream import engine_session
from tenants.services import api_key_create, tenant_create
from tests.engines import Engine
from tests.serving import world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

# Not a request's own work: the hold ticker runs on its clock, and a stream longer than a
# second charges its progress each second (``relay.PROGRESS_SECONDS``). (The lease renewer's
# clock is stopped: ``_no_renewals``.)
BACKGROUND = {s.sha for s in (TICK, PROGRESS)}


@pytest.fixture(autouse=True)
def _no_renewals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leases' renewer wakes every 5 s; a request here lasts well under its leases."""
    monkeypatch.setattr(admission_scripts, "RENEW_EVERY", 3600.0)


def _body(max_tokens: int = 4) -> bytes:
    return orjson.dumps(
        {
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": "Count the round trips."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )


def _key(**tenant_limits: int) -> KeyInfo:
    tenant = tenant_create(slug=f"rt-{uuid.uuid4().hex[:8]}", limits=tenant_limits, actor=None)
    info = key_info_from_db(api_key_create(tenant=tenant, name="k", created_by=None).api_key.prefix)
    assert info is not None
    return info


@contextmanager
def _counted(trips: list[str]) -> Iterator[None]:
    """Each round trip the gateway's client makes on this event loop, named by what it sent:
    a command (a script by its SHA), or ``pipeline`` with the commands it carried."""
    client: Any = redis_async()
    command, pipeline = client.execute_command, client.pipeline

    async def one(*args: Any, **kwargs: Any) -> Any:
        # (A script's first call on a Redis loads it: once per server, not per request.)
        if not (args[0] == "EVALSHA" and args[1] in BACKGROUND) and args[0] != "SCRIPT LOAD":
            trips.append(str(args[0]))
        return await command(*args, **kwargs)

    def batched(*args: Any, **kwargs: Any) -> Any:
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        async def sent(*a: Any, **kw: Any) -> Any:
            trips.append("pipeline:" + ",".join(str(c[0][0]) for c in pipe.command_stack))
            return await execute(*a, **kw)

        pipe.execute = sent
        return pipe

    client.execute_command, client.pipeline = one, batched
    try:
        yield
    finally:
        client.execute_command, client.pipeline = command, pipeline


async def _request(key: KeyInfo) -> None:
    life = await Lifecycle.begin(key=key, raw_body=_body(), endpoint="chat.completions")
    async with life:
        await life.start()
        async for _ in life:
            pass


async def _listener_idle(pool: str) -> None:
    """The pool's grant listener back to its long wait (on a client of its own). A first
    request that waited for its grant (a slow machine: it failed a CI run) leaves the
    listener on its short clock, whose next ``BLPOP`` on the shared client would be counted
    as the second request's."""
    process = admission_module.admission()
    async with asyncio.timeout(10):  # only a listener that never idles reaches it
        while pool not in process.listening_idle:  # noqa: ASYNC110 - a plain set, no event
            await asyncio.sleep(0.01)  # the listener's own clock (TICK_SECONDS): no event


def _run(scenario: Any) -> Any:
    async def closing() -> Any:
        try:
            return await scenario()
        finally:
            await engine_session().close()
            await redis_async().aclose()

    return asyncio.run(closing())


def test_a_request_admitted_at_once_costs_redis_two_round_trips(engine: Engine) -> None:
    world_rows([engine])
    catalog_publish()
    key = _key(rpm=100, tpm=100_000, max_concurrency=4)
    trips: list[str] = []

    async def scenario() -> None:
        await _request(key)  # the first: the catalog and policies read, the listener started
        await _listener_idle("online")
        with _counted(trips):
            await _request(key)

    _run(scenario)
    assert len(trips) == 2, trips
    assert trips[0].startswith("pipeline:") and trips[0].count("EVALSHA") == 2  # ACQUIRE, ENQUEUE
    assert "XADD" in trips[1] and "SADD" in trips[1]  # the end: slot, limits, record, last use


def test_a_refused_request_leaves_nothing_in_admission_and_goes_one_at_a_time_after(
    engine: Engine,
) -> None:
    """A request its limits refuse had ENQUEUE run beside its ACQUIRE: that is undone (no
    slot, no place in the queue, no service charged); the key's next requests, in the next
    seconds, take their limits before they ask admission."""
    world_rows([engine])
    catalog_publish()
    key = _key(rpm=1)
    trips: list[str] = []

    async def scenario() -> None:
        await _request(key)
        with _counted(trips), pytest.raises(ApiError) as refused:
            await _request(key)
        assert refused.value.status == 429
        # It went the one-trip way (nothing had refused the key yet): ACQUIRE beside ENQUEUE,
        # then ENQUEUE's grant given back, then the refusal noted for the dashboard.
        assert trips[0] == "pipeline:EVALSHA,EVALSHA", trips
        assert limits.refused_lately(key)
        trips.clear()
        with _counted(trips), pytest.raises(ApiError):
            await _request(key)

    _run(scenario)
    # Refused alone now: ACQUIRE, then the refusal noted for the dashboard; no ENQUEUE.
    assert trips[0] == "EVALSHA" and not any("EVALSHA,EVALSHA" in t for t in trips), trips
    state = queue_state("online")
    assert set(state.in_flight.values()) == {0} and not state.running and not state.queued
