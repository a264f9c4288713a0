"""Run the whole test suite as groups side by side: ``make test`` (tests/README.md).

Most of the suite's wall time is spent waiting: on an engine starting, on a Celery worker, on
a stream. One pytest at a time left the machine's two cores idle three quarters of the time,
so the suite runs as four pytest processes at once, each a world of its own:

- ``quick``: the tests that need neither an engine, a live stack nor a browser;
- ``inference``: the engine and stack tests under ``tests/inference`` (the gateway);
- ``platform``: every other engine, stack and browser test (batches, moderation, adapters,
  billing, the dashboard);
- ``cluster``: the tests of what the data plane keeps in Redis (admission, limits, the
  catalog, the usage spool, …) again, with that state on a real Redis Cluster.

The first three are a partition of the suite by construction (the first by the marks, the
other two by folder); no group shares state with another: each has its own test database
(``test_<name>_<group>``),
its own Redis database (and so its own Celery broker: a stack's worker never takes another
group's task), its own ``var/`` directory (uploads, adapter copies) and its own log folder
under ``var/test-logs/``. Each starts the engines its own tests use.

Every group's output is printed when it ends; then the 30 slowest tests of the run, and the
groups' wall times. The exit status is non-zero when any group failed.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
LIVE = "engine or stack or browser"


@dataclass(frozen=True)
class Group:
    name: str
    args: tuple[str, ...]
    redis_db: int
    env: tuple[tuple[str, str], ...] = ()


# Redis database 15 is `make pytest`'s and `make test-quick`'s, 14 and 13 the benchmarks'
# (bench/harness.py): any of them may run beside. (The cluster group's 9 holds its Celery
# broker only.)
# What the data plane keeps in Redis, run again with that state on a real Redis Cluster
# (devkit/redis_cluster.py; Celery and Channels stay on the group's plain database).
CLUSTER_TESTS = (
    "tests/inference/test_cluster.py",
    "tests/inference/test_admission.py",
    "tests/inference/test_limits.py",
    "tests/inference/test_lua.py",
    "tests/inference/test_seams.py",
    "tests/inference/test_priority_units.py",
    "tests/inference/test_cache_units.py",
    "tests/test_catalog_contract.py",
    "tests/billing/test_spool.py",
    "tests/billing/test_budget_warnings.py",
    "tests/moderation/test_events_drain.py",
)

GROUPS = (
    Group("quick", ("-m", f"not ({LIVE})", f"--ignore={CLUSTER_TESTS[0]}"), redis_db=10),
    Group(
        "cluster",
        ("-m", f"not ({LIVE})", *CLUSTER_TESTS),
        redis_db=9,
        env=(("INFERPLANE_TEST_STATE", "cluster"),),
    ),
    Group("inference", ("-m", LIVE, "tests/inference"), redis_db=12),
    Group("platform", ("-m", LIVE, "--ignore=tests/inference"), redis_db=11),
)


def _with_path(url: str, path: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=path))


def group_env(group: Group, database_url: str, redis_url: str) -> dict[str, str]:
    """The environment of one group's pytest: a database, a Redis database and a var/ of
    its own."""
    database = urlsplit(database_url).path.lstrip("/")
    var = ROOT / "var" / "test-groups" / group.name
    return {
        **os.environ,
        "DATABASE_URL": _with_path(database_url, f"/{database}_{group.name}"),
        "REDIS_URL": _with_path(redis_url, f"/{group.redis_db}"),
        "INFERPLANE_VAR_DIR": str(var),
        "INFERPLANE_TEST_LOG_DIR": str(ROOT / "var" / "test-logs" / group.name),
        **dict(group.env),
    }


@dataclass
class Running:
    group: Group
    process: subprocess.Popen[bytes]
    output: Path
    junit: Path
    started: float
    ended: float | None = None


def start(group: Group, extra: list[str], database_url: str, redis_url: str) -> Running:
    out_dir = ROOT / "var" / "test-logs"
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / f"{group.name}.out"
    junit = out_dir / f"{group.name}.xml"
    junit.unlink(missing_ok=True)  # never an earlier run's
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",  # several at once would race on .pytest_cache
        f"--junitxml={junit}",
        *group.args,
        *extra,
    ]
    with output.open("wb") as log:
        process = subprocess.Popen(  # noqa: S603 - our own pytest, with our own arguments
            command,
            cwd=ROOT,
            env=group_env(group, database_url, redis_url),
            stdout=log,
            stderr=subprocess.STDOUT,
            # A terminal's Ctrl-C reaches the runner only, which passes it on once: a second
            # one landing in pytest's tear-down would leave its engines running.
            start_new_session=True,
        )
    print(f"[{group.name}] started: {shlex.join(command[2:])}", flush=True)
    return Running(group, process, output, junit, time.monotonic())


def slowest(runs: list[Running], count: int = 30) -> list[tuple[float, str, str]]:
    """The ``count`` slowest tests of the run (set-up, call and tear-down together)."""
    tests: list[tuple[float, str, str]] = []
    for run in runs:
        if not run.junit.exists():
            continue
        try:
            cases = list(ET.parse(run.junit).iter("testcase"))  # noqa: S314 - our pytest's
        except ET.ParseError:  # a group killed while writing it
            continue
        for case in cases:
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            tests.append((float(case.get("time", 0)), run.group.name, name))
    return sorted(tests, reverse=True)[:count]


def main(pytest_args: list[str]) -> int:
    """Run the groups; ``pytest_args`` (make's PYTEST_ARGS) go to every group's pytest: options
    such as ``-x`` or ``-k``, not paths or ``-m``, which would undo the partition."""
    database_url = os.environ["DATABASE_URL"]
    redis_url = os.environ["REDIS_URL"]
    began = time.monotonic()
    runs: list[Running] = []
    signals = 0

    def interrupt(signum: int, frame: object) -> None:
        # The first Ctrl-C asks each pytest to stop (it stops its own engines and stacks:
        # tests/conftest.py); a second one ends them.
        nonlocal signals
        signals += 1
        for run in runs:
            if run.process.poll() is None:
                run.process.send_signal(signal.SIGINT if signals == 1 else signal.SIGTERM)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    runs += [start(group, pytest_args, database_url, redis_url) for group in GROUPS]
    pending = list(runs)
    while pending:
        for run in list(pending):
            if run.process.poll() is None:
                continue
            run.ended = time.monotonic()
            pending.remove(run)
            took = run.ended - run.started
            print(f"\n===== [{run.group.name}] ended in {took:.0f} s =====", flush=True)
            sys.stdout.write(run.output.read_text(errors="replace"))
            sys.stdout.flush()
        time.sleep(0.5)
    print("\n===== the 30 slowest tests (set-up + call + tear-down) =====")
    for seconds, group, name in slowest(runs):
        print(f"{seconds:7.2f}s  [{group}] {name}")
    print("\n===== groups =====")
    # pytest's 5 (no test collected) is a failure unless a selection was given: every group
    # has tests, and one that finds none has lost them.
    passed = {0, 5} if pytest_args else {0}
    for run in runs:
        code = run.process.returncode
        status = {0: "passed", 5: "no tests selected"}.get(code, "") if code in passed else ""
        print(f"[{run.group.name}] {status or f'FAILED ({code})'} in "
              f"{(run.ended or began) - run.started:.0f} s")  # fmt: skip
    print(f"all groups: {time.monotonic() - began:.0f} s")
    return 0 if all(run.process.returncode in passed for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
