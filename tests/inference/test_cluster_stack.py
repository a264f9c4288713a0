"""The whole stack — two web processes, the drains, a Celery worker and beat, a real engine —
with the data plane's state on a Redis Cluster (started for the test by
``devkit.redis_cluster``; Celery and Channels stay on the group's plain Redis): streams in
flight outlive the death of the master that holds the usage stream, nothing is billed twice
or lost, the gateway and the drains recover by themselves, and a batch under way at the
kill ends with every line answered once. (In the ``inference`` group, beside the engine its
other tests use: the cluster group's own engine cost the suite four minutes.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from django.conf import settings
from openai.types.chat import ChatCompletionMessageParam

from batches.models import Line
from billing.models import UsageRecord
from billing.spool import USAGE_STREAM
from devkit.redis_cluster import Cluster
from inference.catalog import catalog_publish
from tests.batches.test_batches import _content, _create, _finished, _line, _until, _upload
from tests.conftest import state_redis_use, test_database_url
from tests.engines import Engine
from tests.live import settled_counters, wait_for
from tests.serving import World, spot_pool, world_rows

pytestmark = pytest.mark.django_db(transaction=True)

STREAMS = 6
# Each stream's length (ignore_eos): seconds of generating on any machine here, against the
# few hundred milliseconds between the streams' first tokens and the kill.
TOKENS = 400
# Each batch line's (ignore_eos): one at a time, the three outlast (by half) any stream that
# began after the first line was claimed; every stream ends after the kill (asserted), so
# the batch cannot have ended before it.
BATCH_TOKENS = TOKENS // 2
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture
def state_on_the_cluster(redis_cluster: Cluster) -> Iterator[Cluster]:
    """This process's data-plane state, and the stacks it starts, on the cluster (emptied)."""
    plain = settings.STATE_REDIS_URL
    for port in redis_cluster.masters():
        redis_cluster.client(port).flushdb()
    state_redis_use(redis_cluster.url)
    try:
        yield redis_cluster
    finally:
        state_redis_use(plain)


def _stream(
    client: openai.OpenAI, first: threading.Barrier, killed: threading.Event
) -> tuple[str, Any, bool]:
    """One streamed answer to its end: (request id, usage, whether it ended after the
    kill). Waits at ``first`` with its first token, so the test acts while every stream is
    open."""
    response = client.chat.completions.with_raw_response.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage, waited = None, False
    for chunk in response.parse():
        if chunk.choices and not waited:
            first.wait(timeout=120)
            waited = True
        usage = chunk.usage or usage
    return response.headers["x-request-id"], usage, killed.is_set()


def test_streams_and_a_batch_outlive_a_master_killed_under_them_nothing_billed_twice(
    engine: Engine, state_on_the_cluster: Cluster, stack_factory: Any
) -> None:
    redis_cluster = state_on_the_cluster
    world_rows([engine])
    spot_pool([engine], max_inflight=1)  # the batch's lines one at a time: the rest queued
    catalog_publish()
    stack = stack_factory(test_database_url(), workers=2, name="cluster")
    world = World(stack=stack, engines=[engine])
    tenant, key = world.tenant(rpm=10_000, max_concurrency=STREAMS + 3 + 2)  # + the lines
    client = stack.openai(key, timeout=120)  # a stuck stream fails the test, not hangs it
    before = settled_counters(engine)

    # A batch is under way too: a line running on the spot pool, the others waiting in its
    # admission queue (on the cluster) when the master dies.
    lines = [_line(f"line-{i}", max_tokens=BATCH_TOKENS, ignore_eos=True) for i in range(3)]
    batch_id = _create(client, _upload(client, lines)).id
    wait_for(lambda: Line.objects.filter(batch_id=batch_id, state=Line.State.RUNNING).exists())

    # The streams get their first tokens; then the master holding the usage stream (where
    # every stream's end writes its record, and the drains read) dies the hard way.
    first = threading.Barrier(STREAMS + 1)
    killed = threading.Event()
    done: list[tuple[str, Any, bool]] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(_stream(client, first, killed))
        except BaseException as error:  # reported by the assertion below
            failed.append(error)
            first.abort()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(STREAMS)]
    for thread in threads:
        thread.start()
    dead = redis_cluster.master_of(USAGE_STREAM)
    try:
        try:
            first.wait(timeout=120)
        except threading.BrokenBarrierError:
            raise AssertionError(f"a stream failed before its first token: {failed}") from None
        redis_cluster.wait_replicated(dead)  # what it holds, its replica has
        redis_cluster.kill(dead)
        killed.set()
        lines_done = Line.objects.filter(batch_id=batch_id, state=Line.State.DONE).count()
        for thread in threads:
            thread.join(timeout=120)
        promoted = redis_cluster.wait_promoted(dead)
        assert promoted != dead
    finally:
        if redis_cluster.processes[dead].poll() is not None:  # (killed: not on an early fail)
            redis_cluster.start_node(dead)  # it comes back as the replica of its old slots
    assert failed == []
    # Every stream ran to its end, whole (the engine does not need Redis to stream), and
    # each ended after the kill: its end's round trip met the failover.
    assert len(done) == STREAMS
    assert {usage.completion_tokens for _, usage, _ in done} == {TOKENS}
    assert all(after_kill for _, _, after_kill in done)
    assert lines_done < 3  # the batch was under way at the kill

    # The gateway serves again by itself (the web processes' clients learn the new master);
    # requests refused meanwhile got a 503, never an answer unmetered.
    def served() -> bool:
        try:
            client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)
        except openai.APIStatusError as error:
            assert error.status_code == 503, error
            return False
        return True

    wait_for(served, timeout=60, every=0.5)
    redis_cluster.wait_ok()

    # The batch under way at the kill ends, every line answered once (the Celery worker's
    # admission is on the cluster too: its queued lines wait out the failover).
    batch = _until(client, batch_id, _finished)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
    output = _content(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == ["line-0", "line-1", "line-2"]
    assert {o["response"]["body"]["usage"]["completion_tokens"] for o in output} == {BATCH_TOKENS}

    # The ledger: every request once (the records of the streams ended while the node was
    # away went straight to Postgres, or through the stream once the replica took over, and
    # the drains read on from the new master), and exactly what the engine counted.
    after = settled_counters(engine)
    counted = tuple(
        after[name] - before[name]
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    )
    rids = {rid for rid, _, _ in done}
    seen: list[tuple[int, int]] = []

    def billed() -> bool:
        records = UsageRecord.objects.filter(tenant=tenant)
        seen.append(
            (sum(r.prompt_tokens for r in records), sum(r.completion_tokens for r in records))
        )
        return seen[-1] == counted

    try:
        wait_for(billed, timeout=60)  # the drains reach the ledger
    except AssertionError:
        raise AssertionError(f"ledger {seen[-1]} against the engine's {counted}") from None
    records = list(UsageRecord.objects.filter(tenant=tenant))
    assert sum(r.completion_tokens for r in records if r.request_id in rids) == STREAMS * TOKENS
    lines_billed = [r for r in records if r.mode == "batch"]
    assert sorted(r.request_id for r in lines_billed) == sorted(
        o["response"]["request_id"] for o in output
    )
