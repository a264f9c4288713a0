"""Batch lines on an online pool's idle room (docs/priority.md, "Lending idle online room"):
the official SDK against a live stack, an online pool on an engine of its own that lends,
and a spot pool on the session's engine. Lent lines are answered and billed once at the
batch rate; online requests take lent room back at once, however often; a model with no spot
pool runs its batches on lent room alone; and a lending engine that dies hands its lines on
like a spot engine does."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import openai
import pytest
import redis as redis_lib

from batches.models import Line
from billing.models import UsageRecord
from billing.services import price_set
from fleet.models import Model, Pool, Replica
from inference.catalog import catalog_publish, pool_prefix
from inference.gateway.admission import queue_state
from inference.services import pool_ensure, replica_probe
from tests.batches.test_batches import _client, _content, _create, _finished, _line, _until, _upload
from tests.engines import Engine, engine_start
from tests.live import Stack, stack_start, wait_for
from tests.serving import World, catalog_everywhere, world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def lender() -> Iterator[Engine]:
    """The online pool's engine, this module's own (the last test kills it)."""
    started = engine_start()
    started.wait_ready()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def lending_stack(serving_db_url: str) -> Iterator[Stack]:
    # Probes every 2 s: a killed lending engine is seen down soon (its port refuses at once).
    # A slow answer is not taken for a dead engine: on a machine shared with the rest of the
    # suite, an engine busy with long lines can take over the default 3 s to answer a probe,
    # and a replica marked down fails its lines (this module asserts no line fails).
    stack = stack_start(
        serving_db_url,
        name="lending",
        extra_env={
            "INFERPLANE_PROBE_INTERVAL_SECONDS": "2",
            "INFERPLANE_PROBE_TIMEOUT_SECONDS": "15",
        },
    )
    yield stack
    stack.stop()


def _rows(lender: Engine, engine: Engine, *, online: int, spot: int, percent: int = 100) -> None:
    """The online pool (``online`` sequences, lending ``percent`` of them) on the lender, a
    spot pool of ``spot`` sequences on the session's engine."""
    world_rows([lender], max_inflight=online, lend_percent=percent, max_queue_wait_seconds=120)
    pool = pool_ensure(
        name="spot",
        kind="spot",
        model=Model.objects.get(name="tiny-chat"),
        replica_urls=[engine.url],
    )
    Pool.objects.filter(pk=pool.pk).update(max_inflight=spot)
    for replica in pool.replicas.all():
        replica_probe(replica=replica)
    assert set(pool.replicas.values_list("state", flat=True)) == {Replica.State.READY}
    catalog_everywhere()


@pytest.fixture
def lending(transactional_db: None, engine: Engine, lender: Engine, lending_stack: Stack) -> World:
    return World(stack=lending_stack, engines=[lender, engine])


def _answered_once(client: openai.OpenAI, batch: Any, tenant_id: int, ids: list[str]) -> list[Any]:
    """Every line in the output once, the ledger exactly the lines answered; the output."""
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {
        "total": len(ids),
        "completed": len(ids),
        "failed": 0,
    }
    output = _content(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(ids)
    records = UsageRecord.objects.filter(tenant_id=tenant_id)
    assert sorted(records.values_list("request_id", flat=True)) == sorted(
        o["response"]["request_id"] for o in output
    )
    completion = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output)
    assert sum(records.values_list("completion_tokens", flat=True)) == completion
    return output


def test_an_idle_online_pool_lends_room_and_each_line_is_billed_once_at_the_batch_rate(
    lending: World, engine: Engine
) -> None:
    _rows(lending.engines[0], engine, online=2, spot=2)
    price_set(
        model=Model.objects.get(name="tiny-chat"),
        input_per_mtok=Decimal(1),
        output_per_mtok=Decimal(2),
        batch_discount_percent=Decimal(50),
        actor=None,
    )
    tenant, key = lending.tenant()
    client = _client(lending, key)
    ids = [f"l{i}" for i in range(12)]
    created = _create(
        client, _upload(client, [_line(i, max_tokens=64, ignore_eos=True) for i in ids])
    )
    batch = _until(client, created.id, _finished, timeout=180)
    _answered_once(client, batch, tenant.pk, ids)
    records = UsageRecord.objects.filter(tenant=tenant)
    # Lines ran on both: the online pool's idle room and the spot pool.
    assert set(records.values_list("pool", flat=True)) == {"online", "spot"}
    assert set(records.values_list("mode", flat=True)) == {"batch"}
    assert set(records.values_list("priority", flat=True)) == {"background"}
    for r in records:  # the batch rate wherever it ran
        expected = (Decimal(r.prompt_tokens) + 2 * r.completion_tokens) / 2
        assert r.cost_micros == int(expected.quantize(Decimal(1), rounding=ROUND_HALF_UP))
    assert queue_state("online").lent == 0  # nothing lent is left behind


def test_online_requests_take_lent_room_back_at_once_and_the_batch_still_completes(
    lending: World,
) -> None:
    """An online load that comes and goes: each time the pool is full of lent lines, online
    requests are admitted by taking their room back (the lines are aborted and run again
    later). The lines lose their room over and over, and still: each answered once, billed
    once, never counted as a failure."""
    # Both pools on the lender's engine: two engines busy at once on a 2-core machine stall
    # each other for seconds (their threads take turns on the same cores), and what this
    # test watches is admission, not the engines' speed.
    _rows(lending.engines[0], lending.engines[0], online=2, spot=1)
    redis = redis_lib.Redis.from_url(lending.stack.env["REDIS_URL"])
    lending_key = pool_prefix("online") + "lending"
    tenant, key = lending.tenant()
    _, online_key = lending.tenant()
    client = _client(lending, key)
    # Enough long lines that lent ones are still running at each of the three rounds below
    # (three run at a time: two lent, one on the spot pool).
    ids = [f"p{i}" for i in range(24)]
    lines = [_line(i, max_tokens=300, ignore_eos=True) for i in ids]
    created = _create(client, _upload(client, lines))
    online = lending.stack.openai(online_key)

    def ask(_: int) -> int:
        reply = online.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens

    taken = 0
    for _ in range(3):
        # The pool's room all lent (the lines ask for it again after each loss).
        wait_for(lambda: queue_state("online").lent == 2, timeout=120, every=0.05)
        before = int(redis.hget(lending_key, "reclaimed") or 0)
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(ask, range(2))) == [4, 4]
        reclaimed = int(redis.hget(lending_key, "reclaimed") or 0) - before
        assert reclaimed >= 1  # admitted by taking lent room, not by waiting for a line
        taken += reclaimed
    batch = _until(client, created.id, _finished, timeout=240)
    _answered_once(client, batch, tenant.pk, ids)
    assert taken >= 3
    # A lost room is neither a failure nor an attempt: no line carries one.
    assert not Line.objects.filter(batch_id=created.id, failures__gt=0).exists()
    # Nothing was billed for the work the engine aborted: one record per line.
    assert UsageRecord.objects.filter(tenant=tenant).count() == len(ids)


def test_a_model_with_no_spot_pool_runs_its_batches_on_lent_room_alone(
    lending: World, engine: Engine
) -> None:
    _rows(lending.engines[0], engine, online=2, spot=2)
    Pool.objects.filter(name="spot").delete()
    # No wait: the batch's validation and its runs read the published catalog in Redis
    # (``catalog_read``), and a line names the lending pool itself.
    catalog_publish()
    tenant, key = lending.tenant()
    client = _client(lending, key)
    ids = [f"o{i}" for i in range(6)]  # three times the room lent: lines wait for their turn
    created = _create(client, _upload(client, [_line(i, max_tokens=32) for i in ids]))
    batch = _until(client, created.id, _finished, timeout=180)
    _answered_once(client, batch, tenant.pk, ids)
    assert set(UsageRecord.objects.filter(tenant=tenant).values_list("pool", flat=True)) == {
        "online"
    }


def test_a_killed_lending_engine_hands_its_lent_lines_on_like_a_spot_engine(
    lending: World, engine: Engine
) -> None:
    lender = lending.engines[0]
    _rows(lender, engine, online=2, spot=2)
    tenant, key = lending.tenant()
    client = _client(lending, key)
    ids = [f"k{i}" for i in range(10)]
    created = _create(
        client, _upload(client, [_line(i, max_tokens=300, ignore_eos=True) for i in ids])
    )
    wait_for(lambda: queue_state("online").lent == 2, timeout=120, every=0.05)
    lender.kill()
    batch = _until(client, created.id, _finished, timeout=240)
    _answered_once(client, batch, tenant.pk, ids)
    # What was on the dead engine ran again elsewhere, billed once.
    assert Line.objects.filter(batch_id=created.id, attempts__gt=1).exists()
    assert UsageRecord.objects.filter(tenant=tenant, pool="spot").exists()
