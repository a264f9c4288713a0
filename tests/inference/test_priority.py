"""Priority classes on a real engine (docs/priority.md): a full pool admits the interactive
band first, a lower band still progresses under a flood at the top, and no request can raise
its own class."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
import redis as redis_lib
from openai.types.chat import ChatCompletionMessageParam

from inference.catalog import pool_prefix
from inference.services import pool_configure
from tenants.models import Tenant
from tenants.services import tenant_update
from tests.live import wait_for
from tests.serving import World

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
BANDS = {"interactive": 0, "standard": 1, "background": 2}


def _one_slot(world: World) -> redis_lib.Redis:
    """The pool runs one sequence at a time, and waits long: every request queues."""
    pool_configure(pool=world.pool(), max_inflight=1, max_queue_wait_seconds=120)
    redis = redis_lib.Redis.from_url(world.stack.env["REDIS_URL"])
    wait_for(lambda: set(redis.hvals(pool_prefix("online") + "replicas")) == {b"1"})
    return redis


def _queued(redis: redis_lib.Redis, tenant: Tenant, priority: str) -> int:
    return int(redis.llen(f"{pool_prefix('online')}q:{BANDS[priority]}:{tenant.pk}"))


@contextmanager
def _holding_the_slot(world: World, key: str) -> Iterator[None]:
    """A streamed answer whose client reads nothing more: it keeps the pool's one slot (an
    answer of ~6 MB cannot all sit in socket buffers) until the client goes."""
    slow = httpx.Client(
        transport=httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]),
        timeout=60,
    )
    holder = world.stack.openai(key, http_client=slow).chat.completions.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=1000,
        service_tier="flex",
        stream=True,
        logprobs=True,
        top_logprobs=20,
        extra_body={"ignore_eos": True},
    )
    next(iter(holder))
    try:
        yield
    finally:
        holder.close()
        slow.close()


def _chat(world: World, key: str, **extra: Any) -> float:
    """One short request; when it ended."""
    reply = world.stack.openai(key).chat.completions.create(
        model="tiny-chat", messages=CHAT, max_tokens=2, **extra
    )
    assert reply.usage is not None
    return time.monotonic()


def test_an_interactive_request_goes_before_everything_waiting_below_it(world: World) -> None:
    """A full pool with a tenant's background work queued and another tenant's standard
    request: the first tenant's interactive request, arriving last, runs at the next free
    slot, then the standard one, then the background ones (without bands its own four would
    go first: a tenant's requests are served in order). Each record says its class."""
    redis = _one_slot(world)
    busy, busy_key = world.tenant()
    tenant_update(tenant=busy, actor=None, priority_class="interactive")
    other, other_key = world.tenant()
    with ThreadPoolExecutor(6) as pool, _holding_the_slot(world, busy_key):
        background = [pool.submit(_chat, world, busy_key, service_tier="flex") for _ in range(4)]
        wait_for(lambda: _queued(redis, busy, "background") == 4)
        standard = pool.submit(_chat, world, other_key)
        wait_for(lambda: _queued(redis, other, "standard") == 1)
        interactive = pool.submit(_chat, world, busy_key)
        wait_for(lambda: _queued(redis, busy, "interactive") == 1)
    # The holder left: the one slot goes to the bands in order.
    first, second = interactive.result(timeout=60), standard.result(timeout=60)
    assert first < second < min(done.result(timeout=60) for done in background)
    wait_for(lambda: len(world.records(tenant=busy)) == 6 and world.records(tenant=other))
    assert [r.priority for r in world.records(tenant=other)] == ["standard"]
    classes = sorted(r.priority for r in world.records(tenant=busy))
    assert classes == ["background"] * 5 + ["interactive"]  # the holder was flex too


def test_a_lower_band_still_progresses_under_a_sustained_flood_at_the_top(world: World) -> None:
    """Four interactive clients keep the one slot's queue full; a background client still
    gets one admission in every SHARE (the starvation guard), while the flood goes on."""
    redis = _one_slot(world)
    flooder, flood_key = world.tenant()
    tenant_update(tenant=flooder, actor=None, priority_class="interactive")
    _, low_key = world.tenant()
    stop = threading.Event()
    flood_done: list[float] = []
    low_done: list[float] = []

    def flood() -> None:
        while not stop.is_set():
            flood_done.append(_chat(world, flood_key))

    with ThreadPoolExecutor(5) as pool:
        flooding = [pool.submit(flood) for _ in range(4)]
        wait_for(lambda: _queued(redis, flooder, "interactive") >= 2)
        try:
            for _ in range(3):
                low = pool.submit(_chat, world, low_key, service_tier="flex")
                # What waited in the top band while the low request waited (read until it is
                # answered: the flood's clients come and go, so one read at the end may fall
                # between two of their requests).
                ahead = [_queued(redis, flooder, "interactive")]
                while not wait([low], timeout=0.02).done:
                    ahead.append(_queued(redis, flooder, "interactive"))
                low_done.append(low.result())
                assert max(ahead) >= 1  # it got through while the flood waited ahead of it
        finally:
            stop.set()
        for f in flooding:
            f.result(timeout=60)
    assert len(low_done) == 3
    assert len(flood_done) >= 3  # the top band ran meanwhile, most of the time


def test_a_request_cannot_raise_its_own_class(world: World) -> None:
    """A standard key asking for the interactive class gets 403 and the reason; an unknown
    tier a 400; a lower class is allowed and is what it runs (and is billed) in."""
    tenant, key = world.tenant()
    client = world.stack.openai(key)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.chat.completions.create(
            model="tiny-chat", messages=CHAT, max_tokens=2, service_tier="priority"
        )
    assert denied.value.code == "priority_not_allowed"
    assert "'standard'" in denied.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny-chat",
            messages=CHAT,
            max_tokens=2,
            extra_body={"service_tier": "urgent"},
        )
    assert bad.value.code == "invalid_service_tier"
    _chat(world, key, service_tier="flex")
    wait_for(lambda: world.records(tenant=tenant))
    assert [r.priority for r in world.records(tenant=tenant)] == ["background"]
