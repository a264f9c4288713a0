"""Writes for the usage ledger."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import orjson
from django.db import IntegrityError, transaction

from billing.models import UsageRecord
from controlplane.redis import redis_sync

log = logging.getLogger(__name__)

USAGE_SPOOL = "ip:usage:spool"
FLUSH_LOCK = "ip:usage:flush-lock"
FLUSH_BATCH = 2000

_FIELDS = {f.attname for f in UsageRecord._meta.concrete_fields} - {"id"}


def _record(data: dict[str, Any]) -> UsageRecord:
    values = {k: v for k, v in data.items() if k in _FIELDS}
    for when in ("started_at", "finished_at"):
        if isinstance(values.get(when), str):
            values[when] = datetime.fromisoformat(values[when])
    return UsageRecord(**values)


def usage_records_insert(records: Iterable[dict[str, Any]]) -> int:
    """Insert records, ignoring any whose request_id is already in the ledger (idempotent)."""
    rows = [_record(r) for r in records]
    try:
        with transaction.atomic():
            UsageRecord.objects.bulk_create(rows, ignore_conflicts=True, batch_size=500)
    except IntegrityError:
        # One bad row (an unknown tenant id, say) must not hold back the rest.
        for row in rows:
            try:
                with transaction.atomic():
                    UsageRecord.objects.bulk_create([row], ignore_conflicts=True)
            except IntegrityError:
                log.error("usage record refused by the database: %s", row.request_id)
    return len(rows)


def usage_spool_flush(*, max_batches: int = 50) -> int:
    """Move spooled records into the ledger. Safe to run anywhere, any number of times:
    one flusher at a time (a Redis lock), rows are trimmed only after they are committed,
    and a replay after a crash is absorbed by the unique request_id."""
    client = redis_sync()
    if not client.set(FLUSH_LOCK, "1", nx=True, ex=60):
        return 0
    moved = 0
    try:
        for _ in range(max_batches):
            items = client.lrange(USAGE_SPOOL, 0, FLUSH_BATCH - 1)
            if not items:
                break
            usage_records_insert(orjson.loads(item) for item in items)  # type: ignore[union-attr]
            client.ltrim(USAGE_SPOOL, len(items), -1)  # type: ignore[arg-type]
            moved += len(items)  # type: ignore[arg-type]
    finally:
        client.delete(FLUSH_LOCK)
    return moved
