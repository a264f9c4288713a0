"""Admission's state for the dashboard and commands (synchronous readers)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import cast

from inference.catalog import pool_prefix
from inference.gateway.admission.scripts import BANDS
from tenants.priority import PRIORITY_CLASSES


@dataclass(frozen=True)
class QueueState:
    """A pool's admission state right now."""

    in_flight: dict[str, int]  # replica id -> sequences running on it
    running: dict[int, int]  # tenant id -> requests running
    waiting: dict[int, int]  # tenant id -> requests queued (VTC), every band
    fcfs_waiting: int  # requests queued under the FCFS policy
    by_band: dict[str, int]  # priority class -> requests queued in its band
    lent: int = 0  # sequences running on room lent to batch lines (``borrow``)
    lend_percent: int = 0  # the share of its capacity the pool lends (0: none)
    reclaimed: int = 0  # lent requests taken back for online ones, ever

    @property
    def queued(self) -> int:
        return sum(self.waiting.values()) + self.fcfs_waiting


def queue_state(pool: str) -> QueueState:
    """What admission holds for ``pool`` in Redis (RedisError if it is unreachable)."""
    from controlplane.redis import redis_sync

    client, base = redis_sync(), pool_prefix(pool)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(base + "rload")
    pipe.hgetall(base + "active")
    pipe.get(base + "lent_seqs")
    pipe.get(base + "lend")
    pipe.hget(base + "lending", "reclaimed")
    for band in range(BANDS):
        pipe.zrange(f"{base}backlog:{band}", 0, -1)
        pipe.llen(f"{base}fcfs:{band}")
    rload, active, lent, lend, reclaimed, *queues = pipe.execute()
    backlogs, fcfs = queues[0::2], [int(n) for n in queues[1::2]]
    pipe = client.pipeline(transaction=False)
    lists = [(band, t) for band, tenants in enumerate(backlogs) for t in tenants]
    for band, t in lists:
        pipe.llen(f"{base}q:{band}:{t.decode()}")
    waiting: Counter[int] = Counter()
    by_band = dict.fromkeys(PRIORITY_CLASSES, 0)
    for (band, t), n in zip(lists, pipe.execute() if lists else [], strict=True):
        waiting[int(t)] += n
        by_band[PRIORITY_CLASSES[band]] += n
    for band, n in enumerate(fcfs):
        by_band[PRIORITY_CLASSES[band]] += n
    return QueueState(
        in_flight={r.decode(): int(n) for r, n in rload.items()},
        running={int(t): int(n) for t, n in active.items() if int(n) > 0},
        waiting={t: n for t, n in waiting.items() if n},
        fcfs_waiting=sum(fcfs),
        by_band=by_band,
        lent=int(lent or 0),
        lend_percent=int(lend or 0),
        reclaimed=int(reclaimed or 0),
    )


def adapter_in_use(pool: str, *, tenant_id: int, engine_name: str) -> bool:
    """Whether a request for the adapter is admitted, or waiting for admission, in ``pool``
    (waiting ones are in their tenant's queue of a band, or the band's one queue under fcfs)."""
    from controlplane.redis import redis_sync

    client, prefix = redis_sync(), pool_prefix(pool)
    rids = cast(list[bytes], client.zrange(prefix + "inflight", 0, -1))
    for band in range(BANDS):
        rids += cast(list[bytes], client.lrange(f"{prefix}q:{band}:{tenant_id}", 0, -1))
        rids += cast(list[bytes], client.lrange(f"{prefix}fcfs:{band}", 0, -1))
    pipe = client.pipeline(transaction=False)
    for rid in rids:
        pipe.hget(prefix + "req:" + rid.decode(), "adapter")
    return engine_name.encode() in pipe.execute()
