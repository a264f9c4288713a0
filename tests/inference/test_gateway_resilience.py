"""The gateway when things go wrong: the database away, an engine killed mid-stream, Redis
restarted, several web processes, the admission queue full."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest
import redis as redis_lib
from django.db import connection
from openai.types.chat import ChatCompletionMessageParam
from psycopg import sql

from billing.models import UsageRecord
from billing.spool import spool_length
from fleet.models import Pool, Replica
from inference.catalog import catalog_publish
from inference.keycache import KEY_ENTRY
from inference.services import pool_configure, replica_probe, replica_set_state
from tenants.keys import key_parse
from tests.engines import LOG_DIR, Engine, started_engine
from tests.live import settled_counters, wait_for
from tests.serving import World, catalog_everywhere, world_rows

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
    # Steady state: a key just made or changed is a tombstone in Redis for its first
    # seconds (inference.keycache), looked up in the database until then; without it the
    # warm request caches the key.
    parsed = key_parse(key)
    assert parsed is not None
    redis_lib.Redis.from_url(stack.env["REDIS_URL"]).delete(KEY_ENTRY.format(prefix=parsed.prefix))
    client = stack.openai(key)
    client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)  # warm
    wait_for(lambda: UsageRecord.objects.count() == 1)

    _lockout(True)
    served = 0
    outage_started = time.monotonic()
    # Postgres away for 10 s: twice the longest period of the stack's own periodic work
    # (beat's tasks run every 1-5 s, the probes every 2 s here), each of which would have
    # touched it.
    while time.monotonic() - outage_started < 10:
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
    assert spool_length() >= served
    assert UsageRecord.objects.count() == 1  # nothing could be written meanwhile

    _lockout(False)
    wait_for(lambda: UsageRecord.objects.count() == served + 1, timeout=60)
    # The flush commits the rows, then deletes the entries it read (billing.spool): the
    # spool empties just after the rows land, not with them.
    assert wait_for(lambda: spool_length() == 0, timeout=20)
    assert UsageRecord.objects.values("request_id").distinct().count() == served + 1


def test_unknown_keys_are_remembered_and_cost_no_query(
    engine: Engine, app_role_url: str, stack_factory: Any
) -> None:
    """A key that does not exist costs the database one look-up, then is remembered for a
    while: with the database locked out, the same unknown key is still answered 401 at once
    (not a 5xx, and no query), and a key nobody has tried yet is answered 503, not 500."""
    world_rows([engine])
    stack = stack_factory(app_role_url, name="unknown")
    unknown = "sk-ip-0123456789ab_" + "x" * 43
    client = stack.openai(unknown)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert redis_lib.Redis.from_url(stack.env["REDIS_URL"]).get("ip:key:0123456789ab") == b"?"
    _lockout(True)
    time.sleep(1.1)  # past the in-process cache: from here on only Redis remembers it
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.InternalServerError) as err:
        stack.openai("sk-ip-ba9876543210_" + "y" * 43).models.list()
    assert err.value.status_code == 503


def _database_restart() -> None:
    """The test database goes away and comes back as a PostgreSQL restart looks to its
    clients: the server ends every connection to it (SQLSTATE 57P01, what a fast restart
    sends each backend) and refuses new ones for a moment. Only this database, so that the
    machine's others (the other groups of ``make test``, a developer's ``make run``) go on
    undisturbed, as they would not if the whole server restarted."""
    settings_dict = connection.settings_dict
    name = sql.Identifier(settings_dict["NAME"])
    with psycopg.connect(
        host=settings_dict["HOST"] or "127.0.0.1",
        port=settings_dict["PORT"] or 5432,
        user=settings_dict["USER"],
        dbname="postgres",
        autocommit=True,
    ) as admin:
        admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(name))
        try:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                [settings_dict["NAME"]],
            )
            time.sleep(2)  # down as long as a fast restart of this machine's server takes
        finally:
            admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(name))


def test_the_gateway_outlives_a_postgres_restart(engine: Engine, stack_factory: Any) -> None:
    """PostgreSQL restarts under a live gateway. Keys already cached keep
    working throughout; keys first used after the restart (and ones whose cache entry has
    expired) work again within seconds; and once Postgres is back nothing answers 5xx.
    (Before, the executor thread that had loaded a key kept its dead connection for good:
    every later first use of a key was a 500 until the web process was restarted.)"""
    world_rows([engine])
    stack = stack_factory(_db_url(), name="pgrestart")
    world = World(stack=stack, engines=[engine])
    _, cached = world.tenant()
    fresh_keys = [world.tenant()[1] for _ in range(3)]
    stack.openai(cached).models.list()  # loaded from the database: a connection in a thread
    redis_client = redis_lib.Redis.from_url(stack.env["REDIS_URL"])
    web_log = LOG_DIR / "pgrestart-web.log"
    log_start = web_log.stat().st_size

    _database_restart()
    connection.close()  # this test's own connection died with the server too

    stack.openai(cached).models.list()  # cached in Redis: never needed the database
    first, *others = fresh_keys

    def works(key: str) -> bool:
        try:
            stack.openai(key).models.list()
        except openai.InternalServerError:  # 503 while Postgres comes back
            return False
        return True

    wait_for(lambda: works(first), timeout=30, every=0.5)
    redis_client.delete(f"ip:key:{cached[6:18]}")  # its Redis entry expired meanwhile
    for key in [cached, *others]:
        for _ in range(3):
            reply = stack.openai(key).chat.completions.create(
                model="tiny-chat", messages=CHAT, max_tokens=2
            )
            assert reply.choices[0].finish_reason == "length"
    with web_log.open("rb") as f:
        f.seek(log_start)
        assert b"unexpected error" not in f.read()


# --- An engine killed mid-stream ---------------------------------------------------------------


@pytest.fixture(scope="module")
def spare_engine() -> Iterator[Engine]:
    """A second replica, for this module to freeze and kill (started when the module asks)."""
    started = started_engine("spare_engine")
    yield started
    started.stop()


def _freeze(engine: Engine, frozen: bool) -> None:
    """SIGSTOP / SIGCONT the whole engine (API server and engine core): it keeps accepting
    connections (the kernel does that) and says nothing, like a hung GPU or a partition."""
    os.killpg(engine.process.pid, signal.SIGSTOP if frozen else signal.SIGCONT)


def _probe(url: str) -> str:
    """One health-probe round for a replica, as beat runs it; its state afterwards."""
    replica = Replica.objects.select_related("pool__model").get(url=url)
    state = replica_probe(replica=replica).state
    catalog_publish()
    return state


def test_a_silent_engine_holds_nothing(
    engine: Engine, spare_engine: Engine, stack_factory: Any
) -> None:
    """A replica that stops answering (SIGSTOP) costs a first-byte timeout before the first
    token (the request moves to the other replica) and a stall timeout mid-stream (the
    stream ends with an error event and [DONE], what was produced is metered, the slot and
    the limits are freed); the probe marks it down, and it serves again once continued."""
    world_rows([engine, spare_engine], max_inflight=1)
    stack = stack_factory(
        _db_url(),
        name="frozen",
        extra_env={
            "INFERPLANE_ENGINE_FIRST_BYTE_TIMEOUT_SECONDS": "4",
            "INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS": "3",
            "INFERPLANE_PROBE_INTERVAL_SECONDS": "3600",  # this test runs the probes itself
        },
    )
    world = World(stack=stack, engines=[engine, spare_engine])
    tenant, key = world.tenant(max_concurrency=10)
    spare = world.pool().replicas.get(url=spare_engine.url)
    engine_row = world.pool().replicas.get(url=engine.url)
    admission = redis_lib.Redis.from_url(stack.env["REDIS_URL"])
    client = stack.openai(key)
    try:
        # 1. Frozen before the first byte: a request admitted to the frozen spare (the other
        # replica drained for the moment, so that it goes there) moves to the other replica,
        # back in the rotation meanwhile, after the first-byte timeout.
        _freeze(spare_engine, True)
        replica_set_state(replica=engine_row, state=Replica.State.DRAINING)
        catalog_everywhere()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                lambda: client.chat.completions.create(
                    model="tiny-chat", messages=CHAT, max_tokens=20
                )
            )
            wait_for(lambda: admission.zcard("ip:{p:online}:inflight") == 1)  # on the spare
            replica_set_state(replica=engine_row, state=Replica.State.READY)
            reply = pending.result(timeout=60)
        assert reply.choices[0].finish_reason == "length"
        (moved,) = wait_for(lambda: world.records(tenant=tenant))
        assert moved.status == "ok" and moved.replica == engine_row.name
        # It waited 4 s on the spare, then moved.
        assert "no answer within 4 s" in moved.error
        assert moved.error.startswith(spare.name) and "127.0.0.1" not in moved.error
        assert _probe(spare_engine.url) == Replica.State.DOWN  # /health does not answer

        _freeze(spare_engine, False)
        assert _probe(spare_engine.url) == Replica.State.READY
        catalog_everywhere()

        # 2. Frozen mid-stream: a long stream on the spare (the other replica drained for the
        # moment, so that it goes there), then the spare is frozen.
        replica_set_state(replica=engine_row, state=Replica.State.DRAINING)
        catalog_everywhere()
        lines: list[str] = []
        running = threading.Event()

        def consume() -> None:
            with httpx.stream(
                "POST",
                f"{stack.url}/v1/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={"model": "tiny-chat", "messages": CHAT, "stream": True, "max_tokens": 600,
                      "ignore_eos": True},
                timeout=60,
            ) as response:  # fmt: skip
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) > 5:
                            running.set()

        thread = threading.Thread(target=consume)
        thread.start()
        assert running.wait(timeout=60), lines
        replica_set_state(replica=engine_row, state=Replica.State.READY)
        _freeze(spare_engine, True)
        thread.join(timeout=120)
        assert lines[-1] == "data: [DONE]"
        assert '"code":"engine_failed"' in lines[-2] and "stalled" in lines[-2]
        # Meanwhile the others' requests go to the replica that answers.
        for _ in range(2):
            reply = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)
            assert reply.choices[0].finish_reason == "length"
        records = wait_for(lambda: len(r := world.records(tenant=tenant)) == 4 and r)
        cut = next(r for r in records if r.status == "error")
        assert cut.replica == spare.name and 0 < cut.completion_tokens < 600  # metered
        assert "stalled" in cut.error
        # Nothing is held for it: no admitted request, no concurrency lease, and the spare
        # is out of the rotation until a probe vouches for it.
        assert admission.zcard("ip:{p:online}:inflight") == 0
        assert admission.zcard(f"ip:rl:{{t:{tenant.pk}}}:conc") == 0
        assert str(spare.pk).encode() not in admission.hkeys("ip:{p:online}:replicas")
        assert _probe(spare_engine.url) == Replica.State.DOWN
    finally:
        _freeze(spare_engine, False)

    # 3. Continued: the probe brings it back and it serves (its aborted stream is gone; the
    # other replica drained for the moment, so that the request goes there).
    assert _probe(spare_engine.url) == Replica.State.READY
    wait_for(lambda: settled_counters(spare_engine)["vllm:num_requests_running"] == 0)
    replica_set_state(replica=engine_row, state=Replica.State.DRAINING)
    catalog_everywhere()
    reply = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    replica_set_state(replica=engine_row, state=Replica.State.READY)
    records = wait_for(lambda: len(r := world.records(tenant=tenant)) == 5 and r)
    assert records[-1].replica == spare.name and records[-1].status == "ok"
    # Every slot came back: failovers, the stall and the probes left no load behind.
    assert {int(v) for v in admission.hvals("ip:{p:online}:rload")} == {0}
    assert admission.zcard("ip:{p:online}:inflight") == 0


def _engine_core(engine: Engine) -> int:
    """The engine-core process under the engine's HTTP server (vLLM runs them apart)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) != engine.process.pid:
                    continue
                if b"EngineCore" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except (OSError, ProcessLookupError):
                continue
    raise AssertionError("no engine-core process found")


def test_a_stuck_engine_core_behind_a_live_http_server_is_marked_down(
    spare_engine: Engine, stack_factory: Any, settings: Any
) -> None:
    """The HTTP server answers /health while the engine core under it is stuck (a hung
    GPU): the probe sees requests running and no token generated for the stall timeout,
    and marks the replica down; once the core moves again, it is ready again."""
    settings.INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS = 3  # the probes run here, in this process
    world_rows([spare_engine], max_inflight=2)
    stack = stack_factory(
        _db_url(),
        name="stuck",
        extra_env={
            "INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS": "3",
            "INFERPLANE_PROBE_INTERVAL_SECONDS": "3600",  # this test runs the probes itself
        },
    )
    world = World(stack=stack, engines=[spare_engine])
    _, key = world.tenant()
    core = _engine_core(spare_engine)
    started = threading.Event()
    ended: list[str] = []

    def consume() -> None:
        with httpx.stream(
            "POST",
            f"{stack.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": "tiny-chat", "messages": CHAT, "stream": True, "max_tokens": 600,
                  "ignore_eos": True},
            timeout=60,
        ) as response:  # fmt: skip
            for i, line in enumerate(response.iter_lines()):
                if i == 10:
                    started.set()
                if line:
                    ended.append(line)

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        assert started.wait(timeout=60)
        os.kill(core, signal.SIGSTOP)
        thread.join(timeout=60)
        assert ended[-1] == "data: [DONE]" and "stalled" in ended[-2]
        assert httpx.get(f"{spare_engine.url}/health", timeout=5).status_code == 200
        _probe(spare_engine.url)  # sees requests running: starts the clock
        time.sleep(3.5)
        assert _probe(spare_engine.url) == Replica.State.DOWN
        replica = Replica.objects.get(url=spare_engine.url)
        assert "engine core is stuck" in replica.last_error
    finally:
        os.kill(core, signal.SIGCONT)
    wait_for(lambda: _probe(spare_engine.url) == Replica.State.READY, timeout=30, every=1)


def test_engine_killed_mid_stream(engine: Engine, spare_engine: Engine, stack_factory: Any) -> None:
    world_rows([engine, spare_engine], max_inflight=4)
    stack = stack_factory(_db_url(), name="kill")
    world = World(stack=stack, engines=[engine, spare_engine])
    tenant, key = world.tenant()
    spare_id = str(world.pool().replicas.get(url=spare_engine.url).pk)
    admission = redis_lib.Redis.from_url(stack.env["REDIS_URL"])
    # Two long streams at once: one per replica (each admits four sequences, one request of
    # n=4). The
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
    spare_name = world.pool().replicas.get(url=spare_engine.url).name
    assert failed.replica == spare_name and failed.prompt_tokens > 0
    assert spare_engine.url not in failed.error and "127.0.0.1" not in failed.error
    # The next requests are served by the remaining replica, even before a probe notices:
    # a connection refused before the first byte is retried on another replica.
    for _ in range(3):
        reply = stack.openai(key).chat.completions.create(
            model="tiny-chat", messages=CHAT, max_tokens=2
        )
        assert reply.choices[0].finish_reason == "length"
    records = wait_for(lambda: len(r := list(UsageRecord.objects.filter(tenant=tenant))) == 5 and r)
    engine_name = world.pool().replicas.get(url=engine.url).name
    assert all(r.replica == engine_name for r in records if r.status == "ok")


def _db_url() -> str:
    from tests.conftest import test_database_url

    return test_database_url()


# --- Redis restarted ---------------------------------------------------------------------------


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
    # Redis goes away once the whole stack runs: the web answers before Celery's worker and
    # beat have connected (a beat that starts while Redis is down never sends a task).
    wait_for(lambda: UsageRecord.objects.count() >= 1, timeout=60)
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
    # The worker reconnects to the broker with a growing backoff (2, 4, 6 s...): the ledger
    # catches up once it is back.
    wait_for(lambda: UsageRecord.objects.count() >= 3, timeout=90)


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
    # One request of n=4 fills a replica of four sequences.
    pool_configure(pool=Pool.objects.get(name="online"), max_inflight=4, max_queue_wait_seconds=2)
    catalog_everywhere()
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
