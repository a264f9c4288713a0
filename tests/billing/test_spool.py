"""The usage spool (a Redis Stream read by a consumer group) into the ledger: every record
exactly once, whatever the flushers and the database do meanwhile."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import msgspec
import orjson
import psycopg
import pytest
import redis
from django.db import OperationalError, connection

import contract
from billing.models import UsageRecord
from billing.services import price_set
from billing.spool import (
    DEAD_LETTERS,
    LEGACY_SPOOL,
    USAGE_GROUP,
    USAGE_STREAM,
    UsageDrain,
    spool_length,
    spool_push,
    usage_spool_flush,
)
from controlplane.redis import redis_sync
from inference.services import model_ensure
from tenants.models import ApiKey, Tenant
from tenants.services import api_key_create
from tests.factories import TenantFactory
from tests.live import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _records(tenant: Tenant, key: ApiKey, n: int) -> list[contract.UsageRecord]:
    now = datetime.now(UTC)
    return [
        contract.UsageRecord(
            request_id=uuid.uuid4().hex,
            tenant_id=tenant.pk,
            api_key_id=key.pk,
            model="tiny-chat",
            endpoint="chat.completions",
            mode="online",
            status="ok",
            prompt_tokens=7,
            completion_tokens=i % 50,
            cached_tokens=0,
            started_at=now,
            finished_at=now,
        )
        for i in range(n)
    ]


@pytest.fixture
def records() -> tuple[Tenant, ApiKey]:
    tenant = TenantFactory.create()
    return tenant, api_key_create(tenant=tenant, name="k", created_by=None).api_key


@pytest.fixture
def ledger_locked(serving_db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """Another session holding the ledger table so that nobody can insert into it."""
    with psycopg.connect(serving_db_url) as locker:
        locker.execute("LOCK TABLE billing_usagerecord IN EXCLUSIVE MODE")
        yield locker


def test_every_record_lands_once_and_replays_are_absorbed(records: Any) -> None:
    tenant, key = records
    batch = _records(tenant, key, 5)
    spool_push(*batch, batch[0])  # the first one twice: a gateway's retry after a timeout
    assert usage_spool_flush() == 6
    assert spool_length() == 0
    assert UsageRecord.objects.count() == 5
    assert usage_spool_flush() == 0


@pytest.mark.single_redis
def test_records_spooled_by_the_previous_version_are_moved_in(records: Any) -> None:
    tenant, key = records
    redis_sync().rpush(LEGACY_SPOOL, *(contract.encode(r) for r in _records(tenant, key, 3)))
    assert usage_spool_flush() == 3
    assert UsageRecord.objects.count() == 3
    assert redis_sync().llen(LEGACY_SPOOL) == 0


def test_a_failed_insert_loses_nothing_and_is_retried(
    records: Any, ledger_locked: Any, settings: Any
) -> None:
    """The database refuses (here: the ledger stays locked past a statement timeout): the
    entries stay pending in the group, and the next flush after the claim delay inserts them."""
    settings.INFERPLANE_USAGE_CLAIM_IDLE_SECONDS = 1
    tenant, key = records
    spool_push(*_records(tenant, key, 3))
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = 300")
    with pytest.raises(OperationalError):
        usage_spool_flush()
    assert spool_length() == 3
    ledger_locked.commit()  # the lock goes
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = 0")
    assert usage_spool_flush() == 0  # still claimed by the failed flusher, for a second
    wait_for(lambda: usage_spool_flush() == 3, timeout=10, every=0.3)
    assert UsageRecord.objects.count() == 3
    assert spool_length() == 0


def test_a_drain_takes_what_it_holds_again_first_after_a_failed_insert(
    records: Any, ledger_locked: Any, settings: Any
) -> None:
    """The drains process's consumer, its insert refused (the ledger locked past a statement
    timeout): the records stay its own, unacknowledged, and its next step after the error
    takes them again at once, before anything new and long before another consumer's claim
    (30 s) could; so an outage leaves one batch in its hands, not one per retry."""
    settings.INFERPLANE_USAGE_CLAIM_IDLE_SECONDS = 30
    tenant, key = records
    drain = UsageDrain()
    assert drain.step(0.05) == 0  # in the group, nothing spooled yet
    first = _records(tenant, key, 3)
    spool_push(*first)
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = 300")
    with pytest.raises(OperationalError):
        drain.step(0.05)
    drain.reset()  # what the drains' loop does after an error
    ledger_locked.commit()  # the database takes writes again
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = 0")
    later = _records(tenant, key, 2)
    spool_push(*later)
    assert drain.step(0.05) == 3  # its own three first
    assert drain.step(0.05) == 2
    assert set(UsageRecord.objects.values_list("request_id", flat=True)) == {
        r.request_id for r in first + later
    }
    assert spool_length() == 0
    assert redis_sync().xpending(USAGE_STREAM, USAGE_GROUP)["pending"] == 0


def test_a_record_the_ledger_refuses_is_kept_aside_and_blocks_nobody(records: Any) -> None:
    tenant, key = records
    good = _records(tenant, key, 2)
    # A negative count violates a check constraint of the ledger.
    bad = msgspec.structs.replace(good[0], request_id=uuid.uuid4().hex, prompt_tokens=-5)
    spool_push(good[0], bad, good[1])
    assert usage_spool_flush() == 3
    assert UsageRecord.objects.count() == 2
    assert spool_length() == 0
    dead = [orjson.loads(x) for x in redis_sync().lrange(DEAD_LETTERS, 0, -1)]
    assert [d["record"]["request_id"] for d in dead] == [bad.request_id]


def test_a_drain_killed_holding_records_loses_and_doubles_nothing(
    records: Any, ledger_locked: Any, serving_db_url: str, stack_factory: Any
) -> None:
    """Two drains processes (``run_drains``, as a deployment runs them) and 10,000 records
    spooled while the ledger table is locked: each drain takes some and sticks in its insert.
    One is killed (SIGKILL, holding its records unacknowledged); once the lock goes, the
    other claims what the dead one held, and every record is in the ledger exactly once and
    the spool is empty."""
    tenant, key = records
    batch = _records(tenant, key, 10_000)
    stack = stack_factory(
        serving_db_url,
        name="spool",
        drains=2,
        extra_env={"INFERPLANE_USAGE_CLAIM_IDLE_SECONDS": "1"},
    )
    client = redis_sync()

    def consumers() -> list[dict[str, Any]]:
        try:
            return list(client.xinfo_consumers(USAGE_STREAM, USAGE_GROUP))
        except redis.ResponseError:  # no drain has made the group yet
            return []

    # Both drains wait on the stream (a consumer is in the group once it reads)...
    wait_for(lambda: len(consumers()) == 2, timeout=60, every=0.2)
    spool_push(*batch)
    # ...and each takes records and sticks in its insert, behind the lock.
    wait_for(lambda: all(int(c["pending"]) > 0 for c in consumers()), timeout=60, every=0.2)
    assert UsageRecord.objects.count() == 0
    dead = stack.processes["drains-2"]
    os.killpg(dead.pid, signal.SIGKILL)
    dead.wait(timeout=10)
    ledger_locked.commit()
    wait_for(lambda: spool_length() == 0, timeout=120, every=0.5)
    ids = list(UsageRecord.objects.values_list("request_id", flat=True))
    assert len(ids) == 10_000
    assert set(ids) == {r.request_id for r in batch}
    assert client.xpending(USAGE_STREAM, USAGE_GROUP)["pending"] == 0


def test_a_record_reaches_the_ledger_as_it_is_spooled(
    records: Any, serving_db_url: str, stack_factory: Any
) -> None:
    """The drain waits on the stream, not on a clock: with its read blocking for 10
    minutes, a record spooled into an idle stack is still in the ledger at once (the time it
    takes is in bench/RESULTS.md: bench.redis_cost)."""
    tenant, key = records
    stack_factory(
        serving_db_url, name="spool-idle", extra_env={"INFERPLANE_DRAIN_BLOCK_SECONDS": "600"}
    )
    client = redis_sync()
    wait_for(lambda: _group_consumers(client) == 1, timeout=60, every=0.2)
    (record,) = _records(tenant, key, 1)
    spool_push(record)
    wait_for(lambda: UsageRecord.objects.filter(request_id=record.request_id).exists(), timeout=60)


def _group_consumers(client: redis.Redis) -> int:
    try:
        return len(client.xinfo_consumers(USAGE_STREAM, USAGE_GROUP))
    except redis.ResponseError:
        return 0


def test_two_flushers_racing_lose_and_double_nothing(records: Any, settings: Any) -> None:
    """Two flushers (threads with a database connection each, as two worker processes)
    drain 20,000 records at once, each taking over what the other holds as soon as it has
    been pending for a moment (claims after 0 s): the batches they insert overlap, and the
    ledger still ends with every record exactly once, priced, and the spool empty."""
    settings.INFERPLANE_USAGE_CLAIM_IDLE_SECONDS = 0
    tenant, key = records
    price_set(
        model=model_ensure(name="tiny-chat", served_name="/m", context_length=2048),
        input_per_mtok=Decimal(1),
        cached_input_per_mtok=Decimal(1),
        output_per_mtok=Decimal(2),
        actor=None,
    )
    batch = _records(tenant, key, 20_000)
    spool_push(*batch)
    moved: list[int] = []
    start = threading.Barrier(2)

    def flusher() -> None:
        try:
            start.wait()
            while spool_length():
                moved.append(usage_spool_flush(max_batches=1))
        finally:
            connection.close()

    threads = [threading.Thread(target=flusher) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ids = list(UsageRecord.objects.values_list("request_id", flat=True))
    assert len(ids) == 20_000
    assert set(ids) == {r.request_id for r in batch}
    assert spool_length() == 0
    costs = dict(UsageRecord.objects.values_list("request_id", "cost_micros"))
    assert all(costs[r.request_id] == 7 + 2 * r.completion_tokens for r in batch)
