"""Real vLLM CPU engines for tests, started with the same script ``make run`` uses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import pytest

from devkit.engines import embed_engine_command, engine_command, guard_engine_command

ROOT = Path(__file__).resolve().parent.parent
# Each group of ``make test`` logs to a folder of its own (devkit/test_groups.py).
LOG_DIR = Path(os.environ.get("INFERPLANE_TEST_LOG_DIR", ROOT / "var" / "test-logs"))
# The tests' engines require an API key, as deployed engines do: tests/conftest.py gives it
# to the test process's settings, tests.live to the live stacks.
ENGINE_API_KEY = "inferplane-test-engine-key"
ENGINE_HEADERS = {"authorization": f"Bearer {ENGINE_API_KEY}"}
START_TIMEOUT = float(os.environ.get("ENGINE_START_TIMEOUT", "300"))
# The tests' engines run eagerly: ``--enforce-eager`` skips vLLM's torch.compile warm-up, most
# of an engine's start on the CPU build (measured: ready in 33 s, against 55 s with vLLM's
# compile cache warm and 100 s cold; and several compiling at once on two cores thrash). The
# price is a slower single stream (128 tokens in 0.5 s against 0.24 s; the same at 64
# streams). The model, scheduler and API server are the same; nothing a test checks
# depends on the compiled graph. ``make run`` and the benchmarks keep vLLM's default.
# Their KV cache is 256 MiB, not ``make run``'s 1 GiB: the tiny model's 1 KiB per token makes
# that 256k tokens, four times what 64 sequences of 1,024 tokens hold, and ~0.8 GB less per
# engine (2.1 GB against 2.9): every group's engines run at once, and one group more, at
# 1 GiB each, ran the machine out of memory (bench/RESULTS.md, the suite's runs).
TEST_ENGINE_ARGS = ("--enforce-eager", "--kv-cache-memory-bytes", "256M")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Engine:
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    extra_args: tuple[str, ...] = field(default=())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"engine on :{self.port} exited early:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"engine on :{self.port} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def running(self) -> bool:
        """Whether any process of the engine's group is left. The group, not the ``sh -c``
        at its head: that one can be gone while vLLM is still shutting down (an engine left
        over from a stop that looked at the shell alone outlived its test session)."""
        self.process.poll()  # a shell that ended is reaped: a zombie would count as left
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        """Die like a lost spot VM: no goodbye to clients."""
        if self.running():
            os.killpg(self.process.pid, signal.SIGKILL)
        self._wait_gone(30)

    def stop(self) -> None:
        if self.running():
            os.killpg(self.process.pid, signal.SIGTERM)
            if not self._wait_gone(30) and self.running():
                os.killpg(self.process.pid, signal.SIGKILL)
                self._wait_gone(30)

    def _wait_gone(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)  # polling the process group, bounded: no wait on the engine's speed
        return True


def engine_popen(command: str, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start an engine as ``make run``'s process manager (honcho) does: through ``sh -c`` in
    a session of its own, so the tests see the scheduling ``make run`` gets (the arguments
    differ by ``TEST_ENGINE_ARGS``)."""
    return subprocess.Popen(  # noqa: S602 - our own command line, as in the Procfile
        command,
        shell=True,
        env={
            **os.environ,
            "INFERPLANE_ENGINE_API_KEY": ENGINE_API_KEY,
            # Gone with this pytest however it ends (scripts/engine.sh).
            "INFERPLANE_DIE_WITH_PID": str(os.getpid()),
        },
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stop() reaches vLLM's children
    )


def engine_start(*extra_args: str, port: int | None = None) -> Engine:
    port = port or free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"engine-{port}.log"
    with log_path.open("wb") as log:
        process = engine_popen(engine_command(port, *TEST_ENGINE_ARGS, *extra_args), log)
    return Engine(port=port, process=process, log_path=log_path, extra_args=extra_args)


def guard_engine_start(port: int | None = None) -> Engine:
    """An engine serving the tiny guard model (``tiny-guard``, vLLM ``/classify``)."""
    port = port or free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"guard-engine-{port}.log"
    with log_path.open("wb") as log:
        process = engine_popen(guard_engine_command(port, *TEST_ENGINE_ARGS), log)
    return Engine(port=port, process=process, log_path=log_path)


def embed_engine_start(port: int | None = None) -> Engine:
    """An engine serving the tiny model as an embedding model (``tiny-embed``)."""
    port = port or free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"embed-engine-{port}.log"
    with log_path.open("wb") as log:
        process = engine_popen(embed_engine_command(port, *TEST_ENGINE_ARGS), log)
    return Engine(port=port, process=process, log_path=log_path)


# The engines a session needs. The session's own (``engine``, ``guard_engine``,
# ``lora_engine``, ``embed_engine``) are started together, when the first of them a selected
# test uses is asked for, and live until the end: most of a start is single-threaded Python,
# so on two cores several at once take less than one after another (an idle engine costs no
# CPU; ~2 GiB of memory each). The spare ones, which one module each hangs and kills, start
# when that module asks: five starts at once thrash (tests/README.md). ``tests/conftest.py``
# names the ones the selected tests use (``wanted``).
STARTERS: dict[str, Callable[[], Engine]] = {
    "engine": engine_start,
    "guard_engine": guard_engine_start,
    "lora_engine": lambda: engine_start(
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"
    ),
    "spare_engine": engine_start,
    "embed_engine": embed_engine_start,
    "second_engine": engine_start,
}
TOGETHER = frozenset({"engine", "guard_engine", "lora_engine", "embed_engine"})
wanted: set[str] = set()
_started: dict[str, Engine] = {}


def started_engine(name: str) -> Engine:
    """The engine ``name`` of ``STARTERS``, ready; the session's wanted ones start with it."""
    together = (wanted & TOGETHER) | {name} if name in TOGETHER else {name}
    for other in sorted(together):
        if other not in _started:
            _started[other] = STARTERS[other]()
    engine = _started[name]
    engine.wait_ready()
    return engine


def stop_all() -> None:
    for started in _started.values():
        started.stop()


# Under load (tests/README.md): ``INFERPLANE_TEST_ENGINE_LOAD=K`` keeps K long streams of
# another tenant running on the session's ``engine`` while its tests run (``bench.engine_load``,
# started once the engine is ready, stopped before it). ``make test-under-load`` sets it.
ENGINE_LOAD = int(os.environ.get("INFERPLANE_TEST_ENGINE_LOAD", "0"))
loads: dict[int, EngineLoad] = {}  # by the engine's port
load_summaries: list[str] = []  # printed at the end of the run (tests/conftest.py)


@dataclass
class EngineLoad:
    """``bench.engine_load`` running on an engine: drained (its streams finish, none
    aborted) to read the engine's counters, and what it made is known to the token."""

    engine: Engine
    process: subprocess.Popen[str]
    made: dict[str, float] = field(default_factory=dict)

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            pytest.fail(f"the load on :{self.engine.port} ended: {self.process.wait()}")
        return line.strip()

    def _streaming(self) -> None:
        line = self._line()
        if line != "streaming":
            pytest.fail(f"the load on :{self.engine.port} did not start: {line}")

    def drain(self) -> dict[str, float]:
        """Every stream of the load finished; the engine's prompt and generation counters'
        share of it so far."""
        self.process.send_signal(signal.SIGUSR1)
        line = self._line()
        totals = json.loads(line) if line.startswith("{") else {}
        if not totals.get("drained"):  # its end (a stream failed), not a drain
            pytest.fail(f"the load on :{self.engine.port} ended: {line}")
        self.made = {
            "vllm:prompt_tokens_total": totals["prompt_tokens"],
            "vllm:generation_tokens_total": totals["completion_tokens"],
        }
        return self.made

    def resume(self) -> None:
        """The streams run again; returns once every one is under way."""
        self.process.send_signal(signal.SIGUSR2)
        self._streaming()


@contextmanager
def engine_load(engine: Engine, streams: int) -> Iterator[None]:
    """``streams`` long streams on ``engine`` until the block ends; the block starts once every
    stream has its first token. At the end its summary is printed with the run's, and a load
    that died on the way fails the session (the tests would have run without it)."""
    command = [sys.executable, "-m", "bench.engine_load", "--url", engine.url]
    command += ["--streams", str(streams), "--key", ENGINE_API_KEY]
    errors = (LOG_DIR / f"engine-load-{engine.port}.log").open("w")  # its protocol: stdout
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True)
    errors.close()
    load = EngineLoad(engine, process)
    try:
        load._streaming()
    except BaseException:
        process.kill()
        raise
    loads[engine.port] = load
    try:
        yield
    finally:
        del loads[engine.port]
        alive = process.poll() is None
        process.terminate()
        rest, _ = process.communicate(timeout=30)
        summary = rest.strip().splitlines()[-1:] or ["(nothing)"]
        load_summaries.append(f"load on the engine :{engine.port}: {summary[0]}")
        if not alive:
            pytest.fail(f"the load on :{engine.port} stopped before the tests did: {rest}")


def _session_engine(name: str) -> Iterator[Engine]:
    started = started_engine(name)
    if name == "engine" and ENGINE_LOAD > 0:
        with engine_load(started, ENGINE_LOAD):
            yield started
    else:
        yield started
    started.stop()


@pytest.fixture(scope="session")
def guard_engine() -> Iterator[Engine]:
    """One engine serving the tiny guard model for the whole session."""
    yield from _session_engine("guard_engine")


@pytest.fixture(scope="session")
def embed_engine() -> Iterator[Engine]:
    """One engine serving the tiny model as an embedding model for the whole session."""
    yield from _session_engine("embed_engine")


@pytest.fixture(scope="session")
def lora_engine() -> Iterator[Engine]:
    """One engine with LoRA on for the whole session (two adapters at once); a test that
    loads adapters into it directly unloads them (the gateway's own tests count them)."""
    yield from _session_engine("lora_engine")


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """One vLLM CPU engine serving ``tiny-chat`` for the whole session."""
    yield from _session_engine("engine")
