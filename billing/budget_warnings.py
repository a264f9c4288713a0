"""The gateway's notes that a monthly budget crossed 80%: billing's inbox, in Redis.

The gateway's limits script (``inference/gateway/lua/limits/``) pushes one note per crossing onto
``BUDGET_WARNINGS`` as ``kind|t or k|id|YYYYMM|used|limit``; ``billing.services.
budget_warnings_flush`` (the drains process, blocked on the list until one comes) takes them
off and turns each into an audit event.
Billing owns the key and the format; the gateway only writes to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from controlplane.redis import redis_blocking, redis_sync

BUDGET_WARNINGS = "ip:budget:warnings"


@dataclass(frozen=True)
class BudgetWarning:
    """A monthly budget crossed 80% (noted by RELEASE as the request that crossed it ended)."""

    kind: str  # "tokens" or "spend" (micro-dollars)
    scope: str  # "t" tenant or "k" key
    ident: int  # the tenant's or key's id
    month: str  # YYYYMM
    used: int
    limit: int


def budget_warnings_put_back(warnings: list[BudgetWarning]) -> None:
    """Return notices taken but not written (the database was away) to the head of the
    list, in their order: the next take gets them first."""
    if warnings:
        raw = [
            f"{w.kind}|{w.scope}|{w.ident}|{w.month}|{w.used}|{w.limit}" for w in reversed(warnings)
        ]
        redis_sync().lpush(BUDGET_WARNINGS, *raw)


def budget_warnings_take(
    max_items: int, *, block_seconds: float = 0
) -> tuple[list[BudgetWarning], list[bytes]]:
    """Take up to ``max_items`` noted warnings off Redis: the readable ones, and the raw
    notes that could not be read (for the caller to log). With ``block_seconds``, waits that
    long for the first one when there is none."""
    raw_items: list[bytes] = []
    if block_seconds:
        client = redis_blocking()
        first = client.blpop([BUDGET_WARNINGS], timeout=block_seconds)
        if first is None:
            return [], []
        raw_items = [cast(tuple[bytes, bytes], first)[1]]
        max_items -= 1
    else:
        client = redis_sync()
    if max_items > 0:
        raw_items += cast(list[bytes], client.lpop(BUDGET_WARNINGS, max_items) or [])
    warnings, unreadable = [], []
    for raw in raw_items:
        try:
            kind, scope, ident, month, used, limit = raw.decode().split("|")
            warnings.append(BudgetWarning(kind, scope, int(ident), month, int(used), int(limit)))
        except ValueError:
            unreadable.append(raw)
    return warnings, unreadable
