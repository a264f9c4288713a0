"""The usage spool: where the gateways leave usage records for the ledger, in Redis.

A Redis Stream (``ip:usage:stream``) read through a consumer group, rather than a list and a
lock. Each flusher reads a batch (``XREADGROUP``), inserts it (idempotent on ``request_id``),
and only then acknowledges and deletes exactly the entries it read (``XACK`` + ``XDEL``).
Entries a flusher read but never acknowledged — it died, or sat behind a locked table for
longer than ``INFERPLANE_USAGE_CLAIM_IDLE_SECONDS`` — are claimed by the next flusher
(``XAUTOCLAIM``) and inserted again, which the unique ``request_id`` absorbs. So any number
of flushers can run at once, nothing is deleted before it is committed, and nothing depends
on a lock's expiry: the ledger can neither lose nor double a record.

A record the database cannot take (anything but an outage: bad data, a record a later
version of the code cannot price) is moved to a dead-letter list (``ip:usage:dead``, logged
as an error) so that it cannot block the records behind it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, cast

import msgspec
import orjson
import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError

from contract import UsageRecord, encode, usage_decoder
from controlplane.redis import redis_blocking, redis_sync, state_is_cluster

log = logging.getLogger(__name__)

USAGE_STREAM = "ip:usage:stream"
USAGE_GROUP = "ledger"
DEAD_LETTERS = "ip:usage:dead"
# Before the stream, the spool was a list: drained into the stream by every flush, so records
# a gateway of the previous version spooled during an upgrade still reach the ledger. (Not
# on a Redis Cluster, which no version before the stream ran on: the two keys' slots differ.)
LEGACY_SPOOL = "ip:usage:spool"
FLUSH_BATCH = 10_000  # a commit (a WAL flush) per 10,000 records, not per 2,000
FIELD = b"r"
Entries = list[tuple[bytes, dict[bytes, bytes]]]
# What says the database is away (retry later), as opposed to a record it cannot take.
OUTAGE_ERRORS = (OperationalError, InterfaceError)

_RUN = uuid.uuid4().hex[:8]


def _consumer() -> str:
    """This process's name in the group (computed per call: Celery forks its workers after
    importing this module, and each process must be a consumer of its own)."""
    return f"{socket.gethostname()}-{os.getpid()}-{_RUN}"


# Moves the legacy list into the stream atomically (its own file, as every script here).
_MIGRATE = (Path(__file__).with_name("lua") / "spool_migrate.lua").read_text()


def spool_push(*records: UsageRecord) -> None:
    """Spool records synchronously (the gateway uses its own pipeline; see metering)."""
    pipe = redis_sync().pipeline(transaction=False)
    for record in records:
        pipe.xadd(USAGE_STREAM, {FIELD: encode(record)})
    pipe.execute()


def spool_length() -> int:
    """Records spooled and not yet in the ledger (read-but-unacknowledged ones included)."""
    return int(redis_sync().xlen(USAGE_STREAM))


def _ensure_group(client: redis.Redis) -> None:
    try:
        client.xgroup_create(USAGE_STREAM, USAGE_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _next_batch(client: redis.Redis) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Entries abandoned by another flusher first, then new ones."""
    idle_ms = settings.INFERPLANE_USAGE_CLAIM_IDLE_SECONDS * 1000
    claimed = client.xautoclaim(
        USAGE_STREAM, USAGE_GROUP, _consumer(), min_idle_time=idle_ms, count=FLUSH_BATCH
    )
    entries = claimed[1]
    entries = [e for e in entries if e and e[1]]  # entries deleted meanwhile come back empty
    if entries:
        return entries
    read = client.xreadgroup(USAGE_GROUP, _consumer(), {USAGE_STREAM: ">"}, count=FLUSH_BATCH)
    if not read:
        return []
    batch: list[tuple[bytes, dict[bytes, bytes]]] = cast(list[Any], read)[0][1]
    return batch


def _dead_letter(client: redis.Redis, item: dict[str, Any]) -> None:
    log.error("usage spool entry refused by the ledger, kept in %s: %s", DEAD_LETTERS, item)
    client.rpush(DEAD_LETTERS, orjson.dumps(item, default=str))


def _insert(client: redis.Redis, records: list[UsageRecord]) -> None:
    """Insert a batch. A batch the database refuses for its content is retried record by
    record, and a record refused on its own goes to the dead letters; an outage propagates
    (the entries stay pending and are retried)."""
    from billing.services import usage_records_insert

    try:
        usage_records_insert(records)
        return
    except OUTAGE_ERRORS:
        raise
    except Exception:
        log.warning(
            "the ledger refused a batch of %d records; inserting them one by one", len(records)
        )
    for record in records:
        try:
            usage_records_insert([record])
        except OUTAGE_ERRORS:
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            _dead_letter(client, {"record": msgspec.to_builtins(record), "error": error})


def _move(client: redis.Redis, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> int:
    """Insert the records of ``entries`` (read from the group), then acknowledge and delete
    exactly them."""
    records = []
    for _, fields in entries:
        try:
            records.append(usage_decoder.decode(fields[FIELD]))
        except (KeyError, msgspec.DecodeError) as exc:
            _dead_letter(client, {"entry": repr(fields), "error": f"unreadable: {exc}"})
    if records:
        _insert(client, records)
    ids = [entry_id for entry_id, _ in entries]
    pipe = client.pipeline(transaction=True)
    pipe.xack(USAGE_STREAM, USAGE_GROUP, *ids)
    pipe.xdel(USAGE_STREAM, *ids)
    pipe.execute()
    return len(entries)


def _prepare(client: redis.Redis) -> None:
    """The group exists, and the legacy list is in the stream."""
    _ensure_group(client)
    _migrate_legacy(client)


def _migrate_legacy(client: redis.Redis) -> None:
    if state_is_cluster():
        return
    while client.eval(_MIGRATE, 2, LEGACY_SPOOL, USAGE_STREAM, FLUSH_BATCH):
        pass


def usage_spool_flush(*, max_batches: int = 50) -> int:
    """Move spooled records into the ledger; safe to run anywhere, any number at once."""
    client = redis_sync()
    _prepare(client)
    moved = 0
    for _ in range(max_batches):
        entries = _next_batch(client)
        if not entries:
            break
        moved += _move(client, entries)
    if not moved:
        _prune_consumers(client)
    return moved


# After a read that found records, the drain waits this long before the next: records that
# come meanwhile go in together (a record costs the stream a read, an acknowledgement and a
# delete, and the ledger a commit, per batch), while the first of a burst goes in at once.
LINGER = 0.2
# The drain refreshes the rollups of the days it wrote to at most this often (the dashboard's
# usage pages read them); records other writers insert are rolled up by beat's slower net.
ROLLUP_EVERY = 10.0


class UsageDrain:
    """The spool's consumer in the drains process: blocks on the stream until records come
    (``XREADGROUP BLOCK``), claims what a dead flusher left once per claim period (page
    after page while there is more), and rolls up the days it wrote to. After an error (the
    database away) it first takes again what it holds itself, so an outage leaves at most
    one batch in its hands, whatever its length."""

    name = "usage"

    def __init__(self) -> None:
        self.prepared = False
        self.own_first = True  # read what this consumer holds before anything new
        self.claimed_at = 0.0  # monotonic
        self.claim_from = "0-0"  # where the next claim goes on looking (XAUTOCLAIM's cursor)
        self.pruned_at = 0.0
        self.rolled_at = 0.0
        self.dirty = False  # records moved since the last rollup
        self.moved = False  # the last step moved records (the next one lingers first)

    def reset(self) -> None:
        """After an error (the database away, or Redis restarted empty: no group)."""
        self.prepared = False
        self.own_first = True

    def _read(self, client: redis.Redis, since: str, block_ms: int | None) -> Entries:
        read = client.xreadgroup(
            USAGE_GROUP, _consumer(), {USAGE_STREAM: since}, count=FLUSH_BATCH, block=block_ms
        )
        return cast(list[Any], read)[0][1] if read else []

    def step(self, block_seconds: float) -> int:
        from billing.services import daily_usage_refresh_stale

        client = redis_blocking()
        if self.moved:
            time.sleep(LINGER)
        now = time.monotonic()
        if not self.prepared:
            _ensure_group(client)
            # In the group from now on (a blocked read alone does not make it a consumer):
            # what it takes and never acknowledges is seen, and claimed, by the others.
            client.xgroup_createconsumer(USAGE_STREAM, USAGE_GROUP, _consumer())
            self.prepared = True
        if now - self.pruned_at >= 3600:
            _prune_consumers(client)
            self.pruned_at = now
        entries: Entries = []
        if self.own_first:
            entries = [e for e in self._read(client, "0", None) if e and e[1]]
            self.own_first = bool(entries)
        claim_every = settings.INFERPLANE_USAGE_CLAIM_IDLE_SECONDS
        if not entries and now - self.claimed_at >= claim_every:
            # (and the legacy list, which a gateway of a version before the stream may
            # still be filling during an upgrade)
            _migrate_legacy(client)
            cursor, claimed = client.xautoclaim(
                USAGE_STREAM,
                USAGE_GROUP,
                _consumer(),
                min_idle_time=claim_every * 1000,
                start_id=self.claim_from,
                count=FLUSH_BATCH,
            )[:2]
            entries = [e for e in claimed if e and e[1]]
            self.claim_from = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
            if self.claim_from == "0-0":  # the whole group was looked at: wait a period
                self.claimed_at = now
        if not entries:
            block = block_seconds
            if self.dirty:  # wake in time for the rollup that is due
                block = max(0.01, min(block, self.rolled_at + ROLLUP_EVERY - now))
            entries = self._read(client, ">", max(1, int(block * 1000)))
        moved = _move(client, entries) if entries else 0
        self.moved = moved > 0
        self.dirty = self.dirty or moved > 0
        if self.dirty and time.monotonic() - self.rolled_at >= ROLLUP_EVERY:
            self.rolled_at = time.monotonic()
            self.dirty = False
            daily_usage_refresh_stale()
        return moved


def _prune_consumers(client: redis.Redis) -> None:
    """Forget the group's consumers that hold nothing and were idle for an hour (every
    worker process that ever flushed is one)."""
    for consumer in client.xinfo_consumers(USAGE_STREAM, USAGE_GROUP):
        if int(consumer["pending"]) == 0 and int(consumer["idle"]) > 3_600_000:
            client.xgroup_delconsumer(USAGE_STREAM, USAGE_GROUP, consumer["name"])
