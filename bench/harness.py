"""Shared set-up for the benchmarks: a bench database, a real vLLM CPU engine, a live
gateway (uvicorn + Celery), tenants and keys. Run from the repository root with the
project's virtualenv: ``.venv/bin/python -m bench.<name>`` (``make bench`` runs them all).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devkit.engines import engine_command, guard_engine_command

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "var" / "bench-logs"
DB_URL = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/inferplane_bench")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _spawn(
    name: str, args: list[str], env: dict[str, str] | None = None, cpus: str = ""
) -> subprocess.Popen[bytes]:
    LOGS.mkdir(parents=True, exist_ok=True)
    if not args[0].endswith("engine.sh"):  # (engine.sh does the same itself)
        args = [str(ROOT / "scripts" / "die-with.sh"), *args]
    if cpus:
        args = ["taskset", "-c", cpus, *args]
    with (LOGS / f"{name}.log").open("wb") as log:
        return subprocess.Popen(
            args,
            cwd=ROOT,
            # The bench's engines take no API key (it compares the gateway with direct calls
            # to them), whatever the shell it runs from has set.
            env={
                **{k: v for k, v in os.environ.items() if k != "INFERPLANE_ENGINE_API_KEY"},
                # Every process goes with the benchmark however it ends (scripts/die-with.sh).
                "INFERPLANE_DIE_WITH_PID": str(os.getpid()),
                **(env or {}),
            },
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def _wait_http(url: str, timeout: float, process: subprocess.Popen[bytes], name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{name} exited; see {LOGS / (name + '.log')}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{name} not ready after {timeout:.0f}s; see {LOGS / (name + '.log')}")


@dataclass
class Bench:
    engine_url: str = ""
    gateway_url: str = ""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # pin=True gives the engine CPU 0 to itself; gateway and load generator share CPU 1
    # (the production shape: the gateway never runs on the engine's cores).
    pin: bool = False

    @property
    def gateway_cpus(self) -> str:
        """Where the gateway (and what stands in its place) runs: CPU 1 when pinned."""
        return "1" if self.pin else ""

    def start_engine(self, *extra: str, core: int | None = None) -> str:
        """``core``: the engine alone on that CPU, its OpenMP thread bound to it (two engines
        on two cores, each on its own, as on machines of their own)."""
        port = free_port()
        name = f"engine-{port}"
        # Through `sh -c` in a session of its own, as make run's process manager starts it.
        command = ["sh", "-c", engine_command(port, *extra)]
        cpus = str(core) if core is not None else "0" if self.pin else ""
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(core)} if core is not None else None
        self.processes[name] = _spawn(name, command, env, cpus=cpus)
        if self.pin:
            os.sched_setaffinity(0, {1})
        self.engine_url = f"http://127.0.0.1:{port}"
        _wait_http(f"{self.engine_url}/health", 300, self.processes[name], name)
        return self.engine_url

    def stop_engine(self, url: str) -> None:
        """Stop the engine started at ``url`` (``start_engine``)."""
        _stop(self.processes.pop(f"engine-{url.rsplit(':', 1)[1]}"))

    def web_cpu_seconds(self, name: str = "web") -> float:
        """CPU time (user + system) the web server (or another process by ``name``) has used
        so far: its process and every process under it (uvicorn's workers), from /proc."""
        web = self.processes.get(name)
        if web is None:
            return 0.0
        tick = os.sysconf("SC_CLK_TCK")
        children: dict[int, list[int]] = {}
        stats: dict[int, list[str]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            pid = int(entry)
            stats[pid] = fields
            children.setdefault(int(fields[1]), []).append(pid)
        total, todo = 0.0, [web.pid]
        while todo:
            pid = todo.pop()
            if pid in stats:
                total += (int(stats[pid][11]) + int(stats[pid][12])) / tick
            todo.extend(children.get(pid, []))
        return total

    def start_guard_engine(self, *, core: int | None = None) -> str:
        """The tiny guard classifier, as the Procfile's ``engine-guard`` starts it."""
        port = free_port()
        name = f"guard-engine-{port}"
        command = ["sh", "-c", guard_engine_command(port)]
        cpus = str(core) if core is not None else "0" if self.pin else ""
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(core)} if core is not None else None
        self.processes[name] = _spawn(name, command, env, cpus=cpus)
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/health", 300, self.processes[name], name)
        return url

    def start_gateway(
        self, *, workers: int = 1, env: dict[str, str] | None = None, batch_workers: int = 0
    ) -> str:
        """Web, a Celery worker and beat; with ``batch_workers``, a worker of that many
        processes on the batch queue too (as the Procfile's worker-batch)."""
        port = free_port()
        env = {"DATABASE_URL": DB_URL, "REDIS_URL": REDIS_URL, **(env or {})}
        cpus = self.gateway_cpus
        py = [sys.executable, "-m"]
        self.stop_gateway()
        web = [str(ROOT / "scripts" / "web.sh"), "--port", str(port)]  # as `make run` does
        web += ["--workers", str(workers), "--no-access-log", "--lifespan", "off"]
        web += ["--timeout-keep-alive", "75"]
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.processes["web"] = _spawn(f"web-{port}", web, {**env, "PATH": path}, cpus)
        worker = ["celery", "-A", "controlplane", "worker", "-l", "warning", "--concurrency", "1"]
        worker += ["-Q", "celery,adapters"]  # adapter validation has a queue of its own
        worker += ["--without-heartbeat", "--without-gossip", "--without-mingle"]
        self.processes["worker"] = _spawn(f"worker-{port}", [*py, *worker], env, cpus)
        if batch_workers:
            batch = ["celery", "-A", "controlplane", "worker", "-l", "warning", "-Q", "batch"]
            batch += ["-n", "batch@%h", "--concurrency", str(batch_workers)]
            batch += ["--without-heartbeat", "--without-gossip", "--without-mingle"]
            self.processes["worker-batch"] = _spawn(
                f"worker-batch-{port}", [*py, *batch], env, cpus
            )
        beat = ["celery", "-A", "controlplane", "beat", "-l", "warning"]
        beat += ["--schedule", str(LOGS / "beat-schedule")]
        self.processes["beat"] = _spawn(f"beat-{port}", [*py, *beat], env, cpus)
        drains = [sys.executable, str(ROOT / "manage.py"), "run_drains"]  # the ledger's way in
        self.processes["drains"] = _spawn(f"drains-{port}", drains, env, cpus)
        self.gateway_url = f"http://127.0.0.1:{port}"
        _wait_http(f"{self.gateway_url}/healthz", 60, self.processes["web"], f"web-{port}")
        return self.gateway_url

    def start_floor_proxy(self, engine_url: str, *, burn_us: float = 0) -> str:
        """``bench.floor_proxy`` in front of ``engine_url``, where the gateway runs (its core
        when pinned): what any proxy there costs, apart from the gateway's own work."""
        port = free_port()
        host, engine_port = engine_url.removeprefix("http://").rsplit(":", 1)
        command = [sys.executable, "-m", "bench.floor_proxy", host, engine_port, str(port)]
        command += ["--burn-us", str(burn_us)]
        process = _spawn(f"floor-proxy-{port}", command, cpus=self.gateway_cpus)
        self.processes["floor-proxy"] = process
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/health", 30, process, f"floor-proxy-{port}")
        return url

    def stop_gateway(self) -> None:
        for name in ("web", "worker", "worker-batch", "beat", "drains"):
            if name in self.processes:
                _stop(self.processes.pop(name))

    def stop(self) -> None:
        for process in self.processes.values():
            _stop(process)


def django_setup() -> None:
    """Point Django at the bench database (created and migrated if needed)."""
    os.environ["DATABASE_URL"] = DB_URL
    os.environ["REDIS_URL"] = REDIS_URL
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    dbname = DB_URL.rsplit("/", 1)[1]
    admin = DB_URL.rsplit("/", 1)[0] + "/postgres"
    import psycopg

    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [dbname]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{dbname}"')
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()


def seed(engine_urls: list[str], *, max_inflight: int, policy: str = "vtc") -> None:
    from fleet.models import Pool, Replica
    from inference.services import model_ensure, pool_ensure, replica_probe

    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool = pool_ensure(name="online", kind="dedicated", model=model, replica_urls=engine_urls)
    Pool.objects.filter(pk=pool.pk).update(
        max_inflight=max_inflight, policy=policy, max_queue_wait_seconds=600
    )
    for replica in Replica.objects.filter(pool=pool):
        replica_probe(replica=replica)
    from inference.catalog import catalog_publish

    catalog_publish()


def tenant_key(slug: str, *, weight: int = 1) -> str:
    from tenants.models import Tenant
    from tenants.services import api_key_create, tenant_create

    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        tenant = tenant_create(slug=slug, weight=weight, actor=None)
    else:
        Tenant.objects.filter(pk=tenant.pk).update(weight=weight)
    return api_key_create(tenant=tenant, name="bench", created_by=None).secret


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def stream_body(**overrides: Any) -> dict[str, Any]:
    return {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Tell me about fair queuing between tenants."}],
        "max_tokens": 128,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        **overrides,
    }
