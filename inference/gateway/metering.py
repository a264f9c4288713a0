"""The gateway's side of the usage ledger: one record per request, pushed to a Redis spool.

The Celery worker moves the spool into Postgres in batches (``billing.spool``), so the
request path never waits on the database and a Postgres outage costs nothing but delay.
When Redis itself cannot take the record, it goes straight to Postgres.
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from billing.services import usage_records_insert
from billing.spool import FIELD, USAGE_STREAM
from contract import UsageRecord, encode
from inference.gateway.db import run_db
from inference.gateway.lua import Batch

log = logging.getLogger(__name__)


def spool_into(pipe: Batch, record: UsageRecord) -> None:
    """Queue the record on a pipeline that also carries the request's other end-of-life work."""
    pipe.xadd(USAGE_STREAM, {FIELD: encode(record)})


async def store(record: UsageRecord) -> None:
    """A record of its own (not part of a request's end-of-life round trip): spooled, or
    straight to Postgres when Redis cannot take it."""
    try:
        pipe = Batch()
        spool_into(pipe, record)
        await pipe.execute()
    except RedisError:
        await store_directly(record)


async def store_directly(record: UsageRecord) -> None:
    """Redis cannot take the record: straight to Postgres (or, failing that, the log)."""
    data = encode(record)
    try:
        await run_db(usage_records_insert, [record])
    except Exception:
        # Both stores are away: the log line is the record of last resort.
        log.error("USAGE RECORD NOT STORED: %s", data.decode())
