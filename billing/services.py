"""Writes for the usage ledger."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any, cast

import orjson
from django.db import transaction

from billing.models import UsageRecord
from controlplane.redis import redis_sync
from tenants.models import ApiKey, Tenant

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
    """Insert records, ignoring any whose request_id is already in the ledger (idempotent).

    A record naming a tenant or key that does not exist is dropped with an error in the log
    (foreign keys are checked at commit, where one bad row would sink the whole batch).
    """
    rows = [_record(r) for r in records]
    tenants = set(
        Tenant.objects.filter(pk__in={r.tenant_id for r in rows}).values_list("pk", flat=True)
    )
    keys = set(
        ApiKey.objects.filter(pk__in={r.api_key_id for r in rows if r.api_key_id}).values_list(
            "pk", flat=True
        )
    )
    valid = []
    for row in rows:
        if row.tenant_id in tenants and (row.api_key_id is None or row.api_key_id in keys):
            valid.append(row)
        else:
            log.error("usage record names an unknown tenant or key, dropped: %s", row.request_id)
    with transaction.atomic():
        UsageRecord.objects.bulk_create(valid, ignore_conflicts=True, batch_size=500)
    return len(valid)


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
            items = cast(list[bytes], client.lrange(USAGE_SPOOL, 0, FLUSH_BATCH - 1))
            if not items:
                break
            usage_records_insert(orjson.loads(item) for item in items)
            client.ltrim(USAGE_SPOOL, len(items), -1)
            moved += len(items)
    finally:
        client.delete(FLUSH_LOCK)
    return moved
