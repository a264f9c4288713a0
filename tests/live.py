"""A live Inferplane stack for tests: uvicorn (ASGI, N workers), a Celery worker and beat, the
drains (``manage.py run_drains``), against the test database, real Redis and real vLLM engines.

Tests that use one need ``transactional_db`` (``django_db(transaction=True)``): the live
processes only see committed rows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib
from django.conf import settings
from openai import AsyncOpenAI, OpenAI

from tests import contract, engines
from tests.engines import ENGINE_API_KEY, LOG_DIR, ROOT, Engine, free_port

METRICS_TOKEN = "test-metrics-token"  # the stacks' INFERPLANE_METRICS_TOKEN


@dataclass
class Stack:
    url: str
    env: dict[str, str]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def openai(self, key: str, **kwargs: Any) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kwargs)

    def async_openai(self, key: str) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def metrics(self, **headers: str) -> httpx.Response:
        """The gateway's ``GET /metrics``, as Prometheus scrapes it (with the stack's token)."""
        headers = {"authorization": f"Bearer {METRICS_TOKEN}", **headers}
        return httpx.get(f"{self.url}/metrics", headers=headers, timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


# Every live process's log, with where the current test's part of it begins (module and
# session stacks outlive a test): a failing test shows their tails (conftest), so a failure
# in CI's throwaway clone can be read.
SPAWNED_LOGS: dict[Path, int] = {}


def logs_mark() -> None:
    """The current test's part of every log begins here (called as each test is set up)."""
    for path in SPAWNED_LOGS:
        SPAWNED_LOGS[path] = path.stat().st_size if path.exists() else 0


def _spawn(name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    # Each process goes with this run however it ends (a run killed before its teardown left
    # stacks behind), and keeps its own pid (the wrapper execs it): scripts/die-with.sh.
    args = [str(ROOT / "scripts" / "die-with.sh"), *args]
    env = {**env, "INFERPLANE_DIE_WITH_PID": str(os.getpid())}
    with (LOG_DIR / f"{name}.log").open("ab") as log:
        SPAWNED_LOGS[LOG_DIR / f"{name}.log"] = log.tell()
        return subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def stack_start(
    database_url: str,
    *,
    workers: int = 1,
    redis_url: str | None = None,
    name: str = "stack",
    celery: bool = True,
    drains: int = 1,
    extra_env: dict[str, str] | None = None,
) -> Stack:
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url or settings.REDIS_URL,
        "STATE_REDIS_URL": redis_url or settings.STATE_REDIS_URL,
        "INFERPLANE_PROBE_INTERVAL_SECONDS": "2",
        # The sweeper wakes work nobody does (a worker killed by a test) sooner than in
        # production (15 s), so that the tests that kill one wait less.
        "INFERPLANE_BATCH_SWEEP_SECONDS": "5",
        "INFERPLANE_ENGINE_API_KEY": ENGINE_API_KEY,
        "INFERPLANE_METRICS_TOKEN": METRICS_TOKEN,
        **(extra_env or {}),
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    stack = Stack(url=f"http://127.0.0.1:{port}", env=env)
    contract.watch(port)  # every /v1 answer it gives is checked against OpenAI's schema
    bin_dir = Path(sys.executable).parent
    stack.processes["web"] = _spawn(
        f"{name}-web",
        [
            str(ROOT / "scripts" / "web.sh"),  # as `make run` starts it
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--no-access-log",
            "--lifespan",
            "off",
            "--timeout-keep-alive",
            "75",
        ],
        env,
    )
    if celery:
        worker_start(stack, name)
        stack.processes["beat"] = _spawn(
            f"{name}-beat",
            [
                str(bin_dir / "celery"),
                "-A",
                "controlplane",
                "beat",
                "-l",
                "warning",
                "--schedule",
                str(LOG_DIR / f"{name}-beat-{port}"),
            ],
            env,
        )
        for n in range(drains):
            label = "drains" if n == 0 else f"drains-{n + 1}"
            stack.processes[label] = _spawn(
                f"{name}-{label}", [sys.executable, str(ROOT / "manage.py"), "run_drains"], env
            )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for proc_name, process in stack.processes.items():
            if process.poll() is not None:
                stack.stop()
                pytest.fail(f"{proc_name} exited; see {LOG_DIR}/{name}-{proc_name}.log")
        try:
            if httpx.get(f"{stack.url}/healthz", timeout=1).status_code == 200:
                return stack
        except httpx.HTTPError:
            time.sleep(0.2)
    stack.stop()
    pytest.fail(f"web server did not start; see {LOG_DIR}/{name}-web.log")


def worker_start(stack: Stack, name: str) -> subprocess.Popen[bytes]:
    """The stack's Celery worker (again, after a test killed it)."""
    bin_dir = Path(sys.executable).parent
    stack.processes["worker"] = _spawn(
        f"{name}-worker",
        [
            str(bin_dir / "celery"),
            "-A",
            "controlplane",
            "worker",
            # One process for every queue: a worker per queue would cost another Celery
            # start and ~100 MB on every stack, for no test that needs it.
            "-Q",
            "celery,adapters,batch",
            "-l",
            "warning",
            "--concurrency",
            "2",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
        ],
        stack.env,
    )
    return stack.processes["worker"]


def wait_for(predicate: Callable[[], Any], *, timeout: float = 20, every: float = 0.2) -> Any:
    """Poll until ``predicate()`` is truthy (the live processes work asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(every)


def engine_counters(engine: Engine) -> dict[str, float]:
    """The engine's own token counters and queue gauges, from /metrics."""
    wanted = (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    )
    values = dict.fromkeys(wanted, 0.0)
    for line in httpx.get(f"{engine.url}/metrics", timeout=5).text.splitlines():
        name = line.split("{", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def settled_counters(engine: Engine) -> dict[str, float]:
    """The engine's counters once it is idle and they stop moving (its metrics endpoint is
    served by the same starved process as its streams, so a read can lag a little). Under
    load (``make test-under-load``) the load is drained first and started again after, and
    what it made is taken off the prompt and generation counters: they count the tests'
    requests alone, to the token."""
    previous: dict[str, float] = {}
    load = engines.loads.get(engine.port)
    made = load.drain() if load else {}

    def stable() -> dict[str, float] | None:
        nonlocal previous
        current = engine_counters(engine)
        settled = current == previous and current["vllm:num_requests_running"] == 0
        previous = current
        return current if settled else None

    try:
        result: dict[str, float] = wait_for(stable, timeout=30, every=0.5)
    finally:
        if load:
            load.resume()
    return {name: value - made.get(name, 0) for name, value in result.items()}


@pytest.fixture(scope="session")
def serving_db_url(django_db_setup: None) -> str:
    from tests.conftest import test_database_url

    return test_database_url()


@pytest.fixture
def stack_factory() -> Iterator[Callable[..., Stack]]:
    started: list[Stack] = []

    def make(*args: Any, **kwargs: Any) -> Stack:
        stack = stack_start(*args, **kwargs)
        started.append(stack)
        return stack

    yield make
    for stack in started:
        stack.stop()


@pytest.fixture
def private_redis() -> Iterator[tuple[str, Any]]:
    """A Redis of the test's own, to kill and start again (empty: nothing kept on disk):
    ``(url, (start, kill))``."""
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
