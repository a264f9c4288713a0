"""A real Redis Cluster for the tests (and ``bench.scale --cluster``): three masters and a
replica each, on loopback ports, from the machine's own ``redis-server`` and ``redis-cli``
(the Redis the suite already needs).

``cluster_start`` returns when every slot is served and every replica has synced;
``Cluster.kill`` ends a master the hard way and ``Cluster.wait_promoted`` waits for its
replica to take over (the cluster's own failover, ``cluster-node-timeout`` 1 s).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

ROOT = Path(__file__).resolve().parent.parent

MASTERS = 3


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/bin:/usr/bin")
    if found is None:
        raise RuntimeError(f"{name} is needed for the Redis Cluster tests (Debian: redis-server)")
    return found


@dataclass
class Cluster:
    directory: Path
    ports: list[int]  # the masters first, then their replicas in the same order
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    masters_at_kill: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        """``STATE_REDIS_URL`` for it: any node seeds the client."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def command(self, port: int, *args: str) -> Any:
        """A raw command to one node (its raw answer: redis-py parses some cluster ones)."""
        return self.client(port).execute_command(*args)  # type: ignore[no-untyped-call]

    def start_node(self, port: int) -> None:
        node_dir = self.directory / str(port)
        node_dir.mkdir(exist_ok=True)
        # Goes with this test run however it ends (scripts/die-with.sh).
        command = [str(ROOT / "scripts" / "die-with.sh"), _tool("redis-server")]
        command += ["--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
        command += ["--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000"]
        command += ["--save", "", "--appendonly", "no"]
        self.processes[port] = subprocess.Popen(  # noqa: S603 - the machine's redis-server
            command,
            cwd=node_dir,
            env={**os.environ, "INFERPLANE_DIE_WITH_PID": str(os.getpid())},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # die-with.sh ends its own group: this server alone
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client(port).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # a process starting: no event to wait on but its port

    def masters(self) -> list[int]:
        """The ports serving slots now."""
        alive = [p for p in self.ports if self.processes[p].poll() is None]
        nodes = self.command(alive[0], "CLUSTER", "NODES").decode()
        found = []
        for line in nodes.splitlines():
            parts = line.split()
            if "master" in parts[2] and "fail" not in parts[2] and len(parts) > 8:
                found.append(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(found)

    def master_of(self, key: str) -> int:
        slot = key_slot(key.encode())  # computed here: any node may be the one killed
        for start, end, master, *_ in self.command(self.masters()[0], "CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return int(master[1])
        raise LookupError(slot)

    def kill(self, port: int) -> None:
        self.masters_at_kill = set(self.masters())  # the replica promoted is the new one
        self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait(10)

    def wait_replicated(self, master: int) -> None:
        """Every write ``master`` took so far has reached its replica (the replication is
        asynchronous: a master killed before would lose what it had not sent). A write of
        our own, then ``WAIT``: the replica acknowledges everything up to it."""
        for n in range(10_000):
            key = f"inferplane-test:{{wait-{n}}}"  # a key in one of this master's slots
            if self.master_of(key) == master:
                break
        client = self.client(master)
        client.set(key, 1)
        acknowledged = int(client.execute_command("WAIT", 1, 10_000))  # type: ignore[no-untyped-call]
        if acknowledged < 1:
            raise TimeoutError(f"the replica of {master} did not acknowledge")

    def wait_ok(self, timeout: float = 30) -> None:
        """Every live node says the cluster is ok and serves all 16384 slots, and every
        live replica is in sync with its master (one that is not could not take over)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [p for p in self.ports if self.processes[p].poll() is None]
            try:
                infos = [self.command(p, "CLUSTER", "INFO").decode() for p in alive]
                roles = [self.client(p).info("replication") for p in alive]
                if all(
                    "cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos
                ) and all(
                    r["role"] == "master" or r.get("master_link_status") == "up" for r in roles
                ):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not become ok")
            time.sleep(0.1)  # the cluster's gossip: polled, it sends no event we can wait on

    def wait_promoted(self, dead: int, timeout: float = 30) -> int:
        """The port of the replica that took over ``dead``'s slots."""
        deadline = time.monotonic() + timeout
        while True:
            masters = self.masters()
            if dead not in masters and len(masters) == MASTERS:
                self.wait_ok(timeout=max(1, deadline - time.monotonic()))
                (promoted,) = set(masters) - self.masters_at_kill
                return promoted
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica took over from {dead}")
            time.sleep(0.1)  # as above: the failover is seen only by asking


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _node_ports(count: int) -> list[int]:
    """Ports below the ephemeral range whose cluster bus port (+10000) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randint(20000, 29999)  # noqa: S311 - a port, not a secret
        if port not in ports and _free(port) and _free(port + 10000):
            ports.append(port)
    return ports


def cluster_start() -> Cluster:
    cluster = Cluster(
        directory=Path(tempfile.mkdtemp(prefix="inferplane-cluster-")),
        ports=_node_ports(2 * MASTERS),
    )
    try:
        for port in cluster.ports:
            cluster.start_node(port)
        create = ["--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports)]
        subprocess.run(  # noqa: S603 - the machine's redis-cli
            [_tool("redis-cli"), *create, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        cluster.wait_ok()  # each replica has its master's data: a failover loses nothing
    except BaseException:
        cluster_stop(cluster)
        raise
    return cluster


def cluster_stop(cluster: Cluster) -> None:
    for process in cluster.processes.values():
        if process.poll() is None:
            process.terminate()
    for process in cluster.processes.values():
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
    shutil.rmtree(cluster.directory, ignore_errors=True)
