"""The local engine yields the CPU to the gateway however it is started.

On two shared cores a busy vLLM CPU engine at full weight stalls the gateway for seconds
(docs/development.md, "The local engines"). ``scripts/engine.sh`` lowers its scheduling
weight; these tests start it each way a person or a tool does — ``make run``'s process
manager (honcho, on the Procfile's own line), the test fixtures and the benchmarks, and
``setsid`` — and read the kernel's view of the engine process. They stop it as soon as it
exists (no need to wait for the model to load).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.engines import engine_command
from tests.engines import ROOT, engine_popen, free_port
from tests.live import wait_for

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found.append(int(entry.name))
    return found


_found: list[int] = []


def _engine_under(root: int, timeout: float = 30) -> int:
    """The vLLM server process started somewhere below ``root`` (killed after the test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        todo = [root]
        while todo:
            pid = todo.pop()
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            argv = cmdline.split(b"\0")
            # The server itself (not `nice` on its way to exec it, which has the same args).
            if ENGINE_MODULE.encode() in argv and b"python" in Path(argv[0].decode()).name.encode():
                _found.append(pid)
                return pid
            todo.extend(_children(pid))
        time.sleep(0.05)
    raise AssertionError(f"no engine process appeared under {root}")


def _scheduling(pid: int) -> tuple[int, int]:
    """(autogroup nice, process nice) of a process, as the kernel schedules it."""
    autogroup = Path(f"/proc/{pid}/autogroup").read_text()
    match = re.search(r"nice (-?\d+)", autogroup)
    assert match, autogroup
    return int(match[1]), os.getpriority(os.PRIO_PROCESS, pid)


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _procfile_line(name: str) -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {name} in the Procfile")


@pytest.fixture
def stopped() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    while _found:  # whatever escaped its group
        with contextlib.suppress(ProcessLookupError):
            os.kill(_found.pop(), signal.SIGKILL)


@pytest.mark.engine
def test_make_runs_engine_yields_to_the_gateway(
    tmp_path: Path, stopped: list[subprocess.Popen[bytes]]
) -> None:
    """The Procfile's own engine line under honcho, as ``make run`` starts it; Ctrl-C (what
    honcho passes on) still stops it."""
    command = _procfile_line("engine-online").replace("8101", str(free_port()))
    procfile = tmp_path / "Procfile"
    procfile.write_text(f"engine-online: {command}\n")
    honcho = Path(sys.executable).parent / "honcho"
    process = subprocess.Popen(
        [str(honcho), "-f", str(procfile), "-d", str(ROOT), "start"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    stopped.append(process)
    engine = _engine_under(process.pid)
    assert _scheduling(engine) == (10, 10)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) is not None
    assert _gone(engine), "honcho left the engine running"


@pytest.mark.engine
def test_fixture_and_setsid_engines_yield_too(
    tmp_path: Path, stopped: list[subprocess.Popen[bytes]]
) -> None:
    with (tmp_path / "engine.log").open("wb") as log:
        fixture_style = engine_popen(engine_command(free_port()), log)
        stopped.append(fixture_style)
        # Not a group leader when it starts, setsid(1) makes a session in place (no fork).
        setsid_style = subprocess.Popen(
            ["setsid", str(ROOT / "scripts" / "engine.sh"), str(free_port())],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        stopped.append(setsid_style)
    for process in (fixture_style, setsid_style):
        assert _scheduling(_engine_under(process.pid)) == (10, 10)


@pytest.mark.engine
def test_an_engine_goes_with_the_run_that_started_it(
    stopped: list[subprocess.Popen[bytes]],
) -> None:
    """A test run or a benchmark killed before its teardown leaves no engine behind (one
    such engine, ~2.4 GB, once ran a CI machine out of memory): ``INFERPLANE_DIE_WITH_PID``."""
    run = subprocess.Popen(["sleep", "600"])  # the run that starts the engine
    process = subprocess.Popen(
        [str(ROOT / "scripts" / "engine.sh"), str(free_port())],
        env={**os.environ, "INFERPLANE_DIE_WITH_PID": str(run.pid)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    stopped.append(process)
    engine = _engine_under(process.pid)
    run.kill()
    run.wait()
    assert _gone(engine), "the engine outlived the run that started it"


def test_a_stack_process_goes_with_the_run_that_started_it_and_its_watcher_with_it() -> None:
    """The web, workers and drains a test stack starts are wrapped the same way
    (``scripts/die-with.sh``): the command keeps the wrapper's pid (signals and ``poll`` reach
    it), its whole group goes once the run that started it is gone, and a command that ends
    by itself leaves no watcher behind."""
    wrapper = str(ROOT / "scripts" / "die-with.sh")
    run = subprocess.Popen(["sleep", "600"])  # the run that starts the stack
    env = {**os.environ, "INFERPLANE_DIE_WITH_PID": str(run.pid)}
    # A process with a child of its own, as uvicorn's and Celery's are.
    process = subprocess.Popen(
        [wrapper, "sh", "-c", "sleep 600 & wait"], env=env, start_new_session=True
    )
    try:

        def children() -> list[int]:
            return [p for p in _group_members(process.pid) if _cmdline(p) == b"sleep\x00600\x00"]

        child = wait_for(children, timeout=10, every=0.05)
        assert _cmdline(process.pid).startswith(b"sh\0")
        run.kill()
        run.wait()
        assert _gone(process.pid), "the process outlived the run that started it"
        assert _gone(child[0]), "its child outlived the run"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    # A command that ends by itself takes its watcher along.
    alive = subprocess.Popen(["sleep", "600"])
    try:
        env = {**os.environ, "INFERPLANE_DIE_WITH_PID": str(alive.pid)}
        quick = subprocess.Popen([wrapper, "true"], env=env, start_new_session=True)
        quick.wait(timeout=10)
        assert all(_gone(pid, timeout=10) for pid in _group_members(quick.pid))
    finally:
        alive.kill()
        alive.wait()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                members.append(int(stat.parent.name))
    return members
