"""The gateway when things go wrong: the database away, an engine killed mid-stream, Redis
restarted, several web processes, the admission queue full."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis as redis_lib
from django.db import connection
from openai.types.chat import ChatCompletionMessageParam

from billing.models import UsageRecord
from inference.models import Pool
from inference.services import pool_configure
from tests.engines import Engine, engine_start, free_port
from tests.live import wait_for
from tests.serving import World, world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
APP_ROLE = "inferplane_app_test"


# --- The database away -----------------------------------------------------------------------


@pytest.fixture
def app_role_url(serving_db_url: str) -> Iterator[str]:
    """A database role for the live processes, so the test can lock them (only) out."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [APP_ROLE])
        if not cursor.fetchone():
            cursor.execute(f"CREATE ROLE {APP_ROLE} LOGIN")
        cursor.execute(f"ALTER ROLE {APP_ROLE} LOGIN")
        cursor.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {APP_ROLE}")
        cursor.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {APP_ROLE}")
    yield serving_db_url.replace("postgres://postgres@", f"postgres://{APP_ROLE}@")
    _lockout(False)


def _lockout(locked: bool) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER ROLE {APP_ROLE} {'NOLOGIN' if locked else 'LOGIN'}")
        if locked:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                [APP_ROLE],
            )


def test_hot_path_needs_no_database_and_usage_survives_an_outage(
    engine: Engine, app_role_url: str, stack_factory: Any
) -> None:
    """Zero queries, proven: while the live processes cannot reach Postgres at all, every
    request is still served; the usage spooled meanwhile lands once Postgres is back."""
    world_rows([engine])
    stack = stack_factory(app_role_url, name="nodb")
    world = World(stack=stack, engines=[engine])
    _, key = world.tenant(rpm=1000, tpm=10**6, max_concurrency=50)
    client = stack.openai(key)
    client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)  # warm
    wait_for(lambda: UsageRecord.objects.count() == 1)

    _lockout(True)
    spool = redis_lib.Redis.from_url(stack.env["REDIS_URL"])
    served = 0
    outage_started = time.monotonic()
    while time.monotonic() - outage_started < 30:  # Postgres away for 30 s
        client.models.list()
        client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=3)
        list(
            client.completions.create(
                model="tiny-chat",
                prompt="hi",
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        served += 2
        time.sleep(1)
    assert spool.llen("ip:usage:spool") >= served
    assert UsageRecord.objects.count() == 1  # nothing could be written meanwhile

    _lockout(False)
    wait_for(lambda: UsageRecord.objects.count() == served + 1, timeout=60)
    assert spool.llen("ip:usage:spool") == 0
    assert UsageRecord.objects.values("request_id").distinct().count() == served + 1


# --- An engine killed mid-stream ---------------------------------------------------------------


@pytest.fixture(scope="module")
def spare_engine() -> Iterator[Engine]:
    """A second replica, for this module to kill."""
    started = engine_start()
    started.wait_ready()
    yield started
    started.stop()


def test_engine_killed_mid_stream(engine: Engine, spare_engine: Engine, stack_factory: Any) -> None:
    world_rows([engine, spare_engine], max_inflight=1)
    stack = stack_factory(_db_url(), name="kill")
    world = World(stack=stack, engines=[engine, spare_engine])
    tenant, key = world.tenant()
    spare_id = str(world.pool().replicas.get(url=spare_engine.url).pk)
    admission = redis_lib.Redis.from_url(stack.env["REDIS_URL"])
    # Two long streams at once: one per replica (each admits one request at a time). The
    # spare is killed as soon as the stream routed to it has started, so it is surely mid-way
    # (the other engine may start its stream later: waiting for both could let it finish).
    lines: dict[int, list[str]] = {0: [], 1: []}
    on_spare = threading.Event()

    def consume(i: int) -> None:
        with (
            httpx.Client(timeout=60) as client,
            client.stream(
                "POST",
                f"{stack.url}/v1/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={
                    "model": "tiny-chat",
                    "messages": CHAT,
                    "stream": True,
                    "max_tokens": 1000,
                    "ignore_eos": True,
                    "n": 4,
                },
            ) as response,
        ):
            assert response.status_code == 200, response.read()
            rid = response.headers["x-request-id"]
            replica = admission.hget(f"ip:{{p:online}}:req:{rid}", "replica")
            for line in response.iter_lines():
                if line:
                    lines[i].append(line)
                    if replica == spare_id.encode():
                        on_spare.set()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert on_spare.wait(timeout=60)
    spare_engine.kill()
    for t in threads:
        t.join(timeout=120)
    ended = sorted(lines.values(), key=lambda ls: "error" in " ".join(ls[-3:]))
    healthy, broken = ended
    assert healthy[-1] == "data: [DONE]" and '"error"' not in " ".join(healthy)
    assert broken[-1] == "data: [DONE]"
    assert '"code":"engine_failed"' in broken[-2]
    records = wait_for(lambda: len(r := list(UsageRecord.objects.filter(tenant=tenant))) == 2 and r)
    failed = next(r for r in records if r.status == "error")
    # Metered with what the engine had counted (its usage rides on every chunk).
    assert failed.replica == spare_engine.url and failed.prompt_tokens > 0
    # The next requests are served by the remaining replica, even before a probe notices:
    # a connection refused before the first byte is retried on another replica.
    for _ in range(3):
        reply = stack.openai(key).chat.completions.create(
            model="tiny-chat", messages=CHAT, max_tokens=2
        )
        assert reply.choices[0].finish_reason in ("length", "stop")
    records = wait_for(lambda: len(r := list(UsageRecord.objects.filter(tenant=tenant))) == 5 and r)
    assert all(r.replica == engine.url for r in records if r.status == "ok")


def _db_url() -> str:
    from tests.conftest import test_database_url

    return test_database_url()


# --- Redis restarted ---------------------------------------------------------------------------


@pytest.fixture
def private_redis() -> Iterator[tuple[str, Any]]:
    port = free_port()
    args = [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    state: dict[str, subprocess.Popen[bytes]] = {}

    def start() -> None:
        state["p"] = subprocess.Popen(args, stdout=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: _pings(port), timeout=10)

    def kill() -> None:
        os.killpg(state["p"].pid, signal.SIGKILL)
        state["p"].wait()

    start()
    yield f"redis://127.0.0.1:{port}/0", (start, kill)
    kill()


def _pings(port: int) -> bool:
    try:
        return bool(redis_lib.Redis(port=port).ping())
    except redis_lib.ConnectionError:
        return False


def test_gateway_recovers_from_a_redis_restart_by_itself(
    engine: Engine, private_redis: tuple[str, Any], stack_factory: Any
) -> None:
    url, (start, kill) = private_redis
    world_rows([engine])
    stack = stack_factory(_db_url(), redis_url=url, name="redis")
    world = World(stack=stack, engines=[engine])
    _, key = world.tenant(rpm=1000)
    client = stack.openai(key)
    assert client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)
    kill()
    with pytest.raises(openai.InternalServerError) as err:  # refused, never served unmetered
        client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)
    assert err.value.status_code == 503
    start()  # empty: no limits, no queues, no catalog, no cached keys, no scripts

    def served() -> bool:
        try:
            client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)
        except openai.APIError:
            return False
        return True

    wait_for(served, timeout=30, every=0.5)
    headers = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=CHAT, max_tokens=2
    ).headers
    assert int(headers["x-ratelimit-remaining-requests"]) >= 990  # limits live again
    wait_for(lambda: UsageRecord.objects.count() >= 3, timeout=30)


# --- Two web processes -------------------------------------------------------------------------


def test_limits_hold_across_two_web_processes(engine: Engine, stack_factory: Any) -> None:
    world_rows([engine])
    stack = stack_factory(_db_url(), workers=2, name="workers2")
    world = World(stack=stack, engines=[engine])
    _, key = world.tenant(rpm=12)
    results: list[int] = []

    def fire() -> None:
        # A fresh connection each time: the kernel spreads them over both processes.
        response = httpx.post(
            f"{stack.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": "tiny-chat", "messages": CHAT, "max_tokens": 1},
            timeout=60,
        )
        results.append(response.status_code)

    threads = [threading.Thread(target=fire) for _ in range(30)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refilled = int((time.monotonic() - started) / 5)  # the bucket earns one request per 5 s
    assert 12 <= results.count(200) <= 12 + refilled
    assert results.count(429) == 30 - results.count(200)

    _, key2 = world.tenant(max_concurrency=2)
    statuses: list[int] = []
    barrier = threading.Barrier(6)

    def stream() -> None:
        barrier.wait()
        with httpx.stream(
            "POST",
            f"{stack.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key2}"},
            json={
                "model": "tiny-chat",
                "messages": CHAT,
                "max_tokens": 1000,
                "stream": True,
                "ignore_eos": True,
            },
            timeout=60,
        ) as response:
            statuses.append(response.status_code)
            for _ in response.iter_bytes():
                pass

    threads = [threading.Thread(target=stream) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses.count(200) == 2 and statuses.count(429) == 4


# --- The admission queue -----------------------------------------------------------------------


def test_full_pool_queues_then_503_and_leaving_frees_the_queue(world: World) -> None:
    pool_configure(pool=Pool.objects.get(name="online"), max_inflight=1, max_queue_wait_seconds=2)
    time.sleep(1.2)
    _, key = world.tenant()
    # A client that reads nothing more: the response backs up to the gateway, which then
    # holds the slot. Big chunks (20 logprobs each) and a tiny receive buffer make sure
    # the answer (about 6 MB) cannot all sit in socket buffers.
    slow = httpx.Client(
        transport=httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]),
        timeout=60,
    )
    holder = world.stack.openai(key, http_client=slow).chat.completions.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=1000,
        n=4,
        stream=True,
        logprobs=True,
        top_logprobs=20,
        extra_body={"ignore_eos": True},
    )
    next(iter(holder))
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as err:
        world.stack.openai(key).chat.completions.create(
            model="tiny-chat", messages=CHAT, max_tokens=2
        )
    waited = time.monotonic() - started
    assert err.value.status_code == 503 and err.value.code == "overloaded"
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert 1.5 < waited < 10  # it waited for the bounded time, then gave up
    # A client that leaves while queued leaves the queue.
    queued = redis_lib.Redis.from_url(world.stack.env["REDIS_URL"])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{world.stack.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": "tiny-chat", "messages": CHAT, "max_tokens": 2},
            timeout=0.5,
        )
    wait_for(lambda: not any(queued.llen(k) for k in queued.keys("ip:{p:online}:q:*")), timeout=5)
    holder.close()
    # The slot goes to the next request, not to a ghost of the one that left.
    reply = world.stack.openai(key).chat.completions.create(
        model="tiny-chat", messages=CHAT, max_tokens=2
    )
    assert reply.usage is not None
