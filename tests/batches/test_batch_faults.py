"""Batches when processes die mid-work: the Celery worker, or the spot pool's engine,
killed with SIGKILL while lines run. Every line ends answered exactly once, and the ledger
holds exactly the output. A module of its own: its stacks are the only ones whose workers
take batch work."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from batches.models import Line
from billing.models import UsageRecord
from fleet.models import Model, Pool, Replica
from inference.catalog import catalog_publish
from inference.services import pool_ensure, replica_probe
from tenants.models import Tenant
from tenants.services import api_key_create, tenant_create
from tests.batches.test_batches import _content, _create, _finished, _line, _until, _upload
from tests.conftest import run_manage
from tests.engines import ENGINE_HEADERS, Engine, engine_start, started_engine
from tests.live import engine_counters, settled_counters, wait_for, worker_start
from tests.serving import catalog_everywhere, spot_pool, world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

_slugs = itertools.count(1)


@pytest.fixture
def spot_rows(transactional_db: None, engine: Engine) -> None:
    """The tiny model with an online pool and a spot pool on the session's engine."""
    world_rows([engine])
    # Two sequences at a time: a batch's other lines wait their turn in admission, claimed.
    spot_pool([engine], max_inflight=2)
    catalog_everywhere()


@pytest.fixture(scope="module")
def spare() -> Iterator[list[Engine]]:
    """One engine more for this module's engine faults, started when the module asks: the
    hang test lets it go again, so the kill test can kill the same one (one start for
    both); a test that finds it killed (run in another order) starts a new one."""
    held = [started_engine("second_engine")]
    yield held
    held[0].stop()


@pytest.fixture
def second_engine(spare: list[Engine]) -> Engine:
    if not spare[0].running():
        spare[0] = engine_start()
        spare[0].wait_ready()
    return spare[0]


def _tenant(**limits: int | None) -> tuple[Tenant, str]:
    tenant = tenant_create(slug=f"fault-{next(_slugs)}", weight=1, limits=limits, actor=None)
    return tenant, api_key_create(tenant=tenant, name="test", created_by=None).secret


def test_a_worker_killed_mid_batch_loses_and_doubles_nothing(
    spot_rows: None, serving_db_url: str, stack_factory: Any
) -> None:
    """SIGKILL the Celery worker while lines run; a new worker (woken by the sweeper once
    the dead one's leases run out) finishes the batch: every line once, ledger = output."""
    # Leases and run times of seconds: the dead worker's claims and its run task run out
    # soon after the kill (by default a run task is trusted for two minutes).
    stack = stack_factory(
        serving_db_url,
        name="batch-kill",
        extra_env={
            "INFERPLANE_BATCH_LEASE_SECONDS": "5",
            "INFERPLANE_BATCH_RUN_SECONDS": "5",
            "INFERPLANE_BATCH_RUN_GRACE_SECONDS": "5",
        },
    )
    tenant, key = _tenant()
    client = openai.OpenAI(api_key=key, base_url=stack.url + "/v1", max_retries=0)
    n = 16
    file_id = _upload(client, [_line(f"k{i}", max_tokens=96, ignore_eos=True) for i in range(n)])
    created = _create(client, file_id)
    _until(
        client,
        created.id,
        lambda b: b.request_counts is not None and b.request_counts.completed >= 2,
    )
    # Every line is claimed (most wait for their turn in the spot pool's admission queue).
    assert Line.objects.filter(batch_id=created.id, state=Line.State.RUNNING).count() >= 2
    os.killpg(stack.processes["worker"].pid, signal.SIGKILL)
    stack.processes["worker"].wait(timeout=10)
    worker_start(stack, "batch-kill")
    batch = _until(client, created.id, _finished, timeout=180)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
    output = _content(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"k{i}" for i in range(n))
    ledger = UsageRecord.objects.filter(tenant=tenant)
    assert sorted(ledger.values_list("request_id", flat=True)) == sorted(
        o["response"]["request_id"] for o in output
    )
    assert Line.objects.filter(batch_id=created.id, attempts__gt=1).exists()  # some ran again


def test_a_spot_engine_that_hangs_mid_batch_hands_its_lines_on(
    transactional_db: None,
    engine: Engine,
    second_engine: Engine,
    serving_db_url: str,
    stack_factory: Any,
) -> None:
    """One of the spot pool's two engines hangs (SIGSTOP: it keeps its connections open and
    says nothing, like a frozen VM) while lines run on it. A line's answer comes whole, so no
    token's silence gives the hang away: the health probe marks the replica down, and the
    lines waiting on it move to the other replica at once, long before the whole-answer
    bound (set here far beyond the test's patience). Every line once, ledger = output."""
    frozen = second_engine
    try:
        world_rows([engine])
        pool = pool_ensure(
            name="spot",
            kind="spot",
            model=Model.objects.get(name="tiny-chat"),
            replica_urls=[frozen.url, engine.url],
        )
        Pool.objects.filter(pk=pool.pk).update(max_inflight=2)
        for replica in pool.replicas.all():
            replica_probe(replica=replica)
        catalog_publish()
        stack = stack_factory(
            serving_db_url,
            name="batch-hang",
            extra_env={
                "INFERPLANE_PROBE_INTERVAL_SECONDS": "2",
                "INFERPLANE_ENGINE_WHOLE_TIMEOUT_SECONDS": "3600",
            },
        )
        tenant, key = _tenant()
        client = openai.OpenAI(api_key=key, base_url=stack.url + "/v1", max_retries=0)
        n = 24
        # Each line's own prompt: prefix-affine routing spreads them over both replicas from
        # the start (one shared prompt would send them all to one replica while it has room).
        lines = [
            _line(f"h{i}", content=f"Line {i}: say hello.", max_tokens=128, ignore_eos=True)
            for i in range(n)
        ]
        created = _create(client, _upload(client, lines))
        hung = Replica.objects.get(pool__name="spot", url=frozen.url)
        # The replica stops while it runs a line: watched on the engine itself, which says
        # so as soon as it runs one (most of the batch is then still to run).
        wait_for(
            lambda: engine_counters(frozen)["vllm:num_requests_running"] >= 1,
            timeout=120,
            every=0.02,
        )
        os.killpg(frozen.process.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        left = Line.objects.filter(
            batch_id=created.id, state__in=[Line.State.PENDING, Line.State.RUNNING]
        ).count()
        assert left >= 4, f"only {left} lines were left when the replica stopped"
        batch = _until(client, created.id, _finished, timeout=240)
        waited = time.monotonic() - stopped_at
        # Its probe marks it down, asked while it is still stopped (once it runs again the
        # next probe marks it ready within two seconds: CI saw it ready after the SIGCONT).
        wait_for(lambda: Replica.objects.get(pk=hung.pk).state == Replica.State.DOWN)
    finally:
        os.killpg(frozen.process.pid, signal.SIGCONT)  # the next test kills it
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
    assert waited < 240
    output = _content(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"h{i}" for i in range(n))
    ledger = UsageRecord.objects.filter(tenant=tenant)
    assert sorted(ledger.values_list("request_id", flat=True)) == sorted(
        o["response"]["request_id"] for o in output
    )
    # The lines that were on the hung replica finished on the other one: moved there at once
    # (the record says why), or put back and claimed again when the other one was full.
    moved = ledger.filter(error__contains="went down while answering")
    assert not moved.filter(replica=hung.name).exists()
    assert moved.exists() or Line.objects.filter(batch_id=created.id, attempts__gt=1).exists()


def test_a_spot_engine_killed_mid_batch_costs_a_retry_not_a_line(
    transactional_db: None,
    engine: Engine,
    second_engine: Engine,
    serving_db_url: str,
    stack_factory: Any,
) -> None:
    """The batch pool's only engine dies like a lost spot VM (SIGKILL) while lines run; then
    an operator adds a replica (``manage.py replica add``). The lines that were in flight are
    requeued, not failed, and everything left runs on the new replica: every line once,
    ledger = output."""
    doomed = second_engine
    try:
        world_rows([engine])
        pool = pool_ensure(
            name="spot",
            kind="spot",
            model=Model.objects.get(name="tiny-chat"),
            replica_urls=[doomed.url],
        )
        Pool.objects.filter(pk=pool.pk).update(max_inflight=2)
        for replica in pool.replicas.all():
            replica_probe(replica=replica)
        catalog_publish()
        stack = stack_factory(serving_db_url, name="batch-spot")
        tenant, key = _tenant()
        client = openai.OpenAI(api_key=key, base_url=stack.url + "/v1", max_retries=0)
        n = 24  # two run at a time: most are still to run when the engine dies
        lines = [_line(f"s{i}", max_tokens=128, ignore_eos=True) for i in range(n)]
        created = _create(client, _upload(client, lines))
        _until(
            client,
            created.id,
            lambda b: b.request_counts is not None and b.request_counts.completed >= 2,
        )
        # The engine dies with lines on it (two at a time run there, the rest wait their
        # turn); then an operator adds a replica, which joins once its first probe passes.
        assert Line.objects.filter(batch_id=created.id, state=Line.State.RUNNING).exists()
        doomed.kill()
        added = run_manage(
            "replica", "add", "spot", engine.url, env={"REDIS_URL": stack.env["REDIS_URL"]}
        )
        assert added.returncode == 0, added.stderr
        batch = _until(client, created.id, _finished, timeout=240)
    finally:
        doomed.stop()
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
    output = _content(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"s{i}" for i in range(n))
    ledger = UsageRecord.objects.filter(tenant=tenant)
    assert sorted(ledger.values_list("request_id", flat=True)) == sorted(
        o["response"]["request_id"] for o in output
    )
    new = Replica.objects.get(pool__name="spot", url=engine.url)
    assert ledger.filter(replica=new.name).exists()  # the requeued lines ran on the new one
    assert Line.objects.filter(batch_id=created.id, attempts__gt=1).exists()


def test_hostile_lines_are_bounded_and_a_slow_answer_is_not_a_dead_replica(
    spot_rows: None, engine: Engine, serving_db_url: str, stack_factory: Any
) -> None:
    """Through a real worker and engine. A line whose answer takes longer than the
    whole-answer bound is a 504 for that line alone (the replica stays in rotation: the probe
    decides) and, tried as often as a line may be, fails with ``line_attempts_exhausted``.
    Then, on a stack with the default bound: a line whose answer is larger than a batch
    answer may be fails with ``response_too_large`` and is billed what the engine made; the
    batch goes on and its other lines are answered."""
    # The slow line asks for 900 tokens of two sequences (seconds on this engine), against a
    # bound of one second; the other lines go to a stack with the default bound (their
    # answers take about that long here).
    slow_stack = stack_factory(
        serving_db_url,
        name="batch-slow",
        extra_env={
            "INFERPLANE_ENGINE_WHOLE_TIMEOUT_SECONDS": "1",
            "INFERPLANE_BATCH_LINE_MAX_ATTEMPTS": "2",
        },
    )
    tenant, key = _tenant()
    client = openai.OpenAI(api_key=key, base_url=slow_stack.url + "/v1", max_retries=0)
    # What one sequence of the line's prompt costs the engine (its own usage report).
    asked = httpx.post(
        f"{engine.url}/v1/chat/completions",
        headers=ENGINE_HEADERS,
        json=_line("probe", max_tokens=1)["body"],
        timeout=60,
    )
    prompt = asked.json()["usage"]["prompt_tokens"]
    before = settled_counters(engine)
    slow_line = _line("slow", max_tokens=900, n=2, temperature=1, ignore_eos=True)
    batch = _until(client, _create(client, _upload(client, [slow_line])).id, _finished, 180)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 1, "completed": 0, "failed": 1}
    [slow] = _content(client, batch.error_file_id)
    assert slow["response"]["status_code"] == 504
    error = slow["response"]["body"]["error"]
    assert error["code"] == "line_attempts_exhausted" and "2 times" in error["message"]
    assert Line.objects.get(batch_id=batch.id).failures == 1
    # It reached the engine once per attempt (two sequences each) at most: never failed over,
    # never retried on the same replica as if it had died, and the replica never left the
    # ready set. (At most: a sequence the engine had not begun when the bound cut its request
    # counts nothing; on a loaded machine one did, a fresh-clone run failed on 36 against 48.)
    after = settled_counters(engine)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] <= 2 * 2 * prompt
    assert set(Replica.objects.filter(pool__name="spot").values_list("state", flat=True)) == {
        Replica.State.READY
    }
    assert not UsageRecord.objects.filter(tenant=tenant).exists()  # it never finished
    slow_stack.stop()

    stack = stack_factory(
        serving_db_url,
        name="batch-big",
        extra_env={"INFERPLANE_BATCH_MAX_ANSWER_BYTES": str(64 * 1024)},
    )
    client = openai.OpenAI(api_key=key, base_url=stack.url + "/v1", max_retries=0)
    lines = [
        # ~20 alternatives of ~60 bytes for each of 200 tokens: ~250 KB whole.
        _line("big", max_tokens=200, ignore_eos=True, logprobs=True, top_logprobs=20),
        _line("ok-1", max_tokens=1),
        _line("ok-2", max_tokens=1),
    ]
    batch = _until(client, _create(client, _upload(client, lines)).id, _finished, timeout=180)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 1}
    [big] = _content(client, batch.error_file_id)
    assert big["custom_id"] == "big"
    assert (big["response"]["status_code"], big["response"]["body"]["error"]["code"]) == (
        400,
        "response_too_large",
    )
    # Made whole, it is billed whole (its usage read from its end, the rest never held),
    # beside the two answered lines.
    billed = UsageRecord.objects.filter(tenant=tenant)
    assert billed.count() == 3
    assert billed.filter(completion_tokens=200).count() == 1
