"""Reconciliation against a real engine's counters: exact when nothing is lost, and a
deliberately dropped record shows up as exactly its tokens."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from openai.types.chat import ChatCompletionMessageParam

from billing.models import UsageRecord
from billing.reconcile import replica_counters_snapshot
from fleet.models import Replica
from tests.conftest import run_manage
from tests.live import settled_counters, wait_for
from tests.serving import World

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count the tokens"}]


def _reconcile(since: str, pool: str = "online") -> tuple[int, list[dict[str, str]]]:
    out = io.StringIO()
    code = 0
    try:
        call_command("reconcile_usage", "--pool", pool, "--since", since, stdout=out)
    except SystemExit as exc:
        code = int(exc.code or 0)
    header, *rows = out.getvalue().strip().splitlines()
    return code, [dict(zip(header.split(","), row.split(","), strict=True)) for row in rows]


def test_reconciliation_catches_a_dropped_record(world: World) -> None:
    engine = world.engines[0]
    settled_counters(engine)
    start = replica_counters_snapshot(replica=Replica.objects.get(url=engine.url))
    tenant, key = world.tenant()
    client = world.stack.openai(key)
    for i in range(3):
        client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=5 + i)
    stream = client.chat.completions.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 4:
            break  # a client that leaves early: still reconciled
    stream.close()
    wait_for(lambda: UsageRecord.objects.filter(tenant=tenant).count() == 4, timeout=30)
    settled_counters(engine)
    since = (start.taken_at + timedelta(milliseconds=1)).isoformat()

    code, rows = _reconcile(since)
    row = rows[0]
    assert (row["prompt_diff"], row["records"]) == ("0", "4"), rows
    # Exact but for the one documented gap (docs/billing.md, Metering): the decode steps in flight
    # when the client left (the running one and the one scheduled behind it) can add up to
    # two tokens the engine counted and never streamed.
    gap = int(row["generation_diff"])
    assert gap in (0, -1, -2), rows
    assert code == (0 if gap == 0 else 1)
    assert int(row["engine_generation"]) > 0 and row["exact"] == "yes"

    dropped = UsageRecord.objects.filter(tenant=tenant).order_by("id")[1]
    dropped.delete()
    code, rows = _reconcile(since)
    assert code == 1
    assert int(rows[0]["prompt_diff"]) == -dropped.prompt_tokens
    assert int(rows[0]["generation_diff"]) == gap - dropped.completion_tokens


def test_responses_reconcile_exactly_with_the_engine(world: World) -> None:
    """A /v1/responses request is billed the engine's own counts: a whole one, and a streamed
    one that continues it (the whole conversation read again, every token of it billed)."""
    engine = world.engines[0]
    settled_counters(engine)
    start = replica_counters_snapshot(replica=Replica.objects.get(url=engine.url))
    tenant, key = world.tenant()
    client = world.stack.openai(key)
    first = client.responses.create(
        model="tiny-chat", input="Count the tokens", max_output_tokens=5
    )
    with client.responses.create(
        model="tiny-chat",
        input="And again",
        previous_response_id=first.id,
        max_output_tokens=7,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as stream:
        for _ in stream:
            pass
    wait_for(lambda: UsageRecord.objects.filter(tenant=tenant).count() == 2, timeout=30)
    settled_counters(engine)
    since = (start.taken_at + timedelta(milliseconds=1)).isoformat()
    code, rows = _reconcile(since)
    row = rows[0]
    assert (row["prompt_diff"], row["generation_diff"], row["records"]) == ("0", "0", "2"), rows
    assert code == 0 and row["exact"] == "yes"
    assert {r.endpoint for r in UsageRecord.objects.filter(tenant=tenant)} == {"responses"}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pool", "nope"], "no pool named"),
        (["--pool", "online", "--since", "last week"], "--since must be"),
    ],
)
def test_reconcile_bad_input(args: list[str], message: str) -> None:
    from inference.services import model_ensure, pool_ensure

    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool_ensure(name="online", kind="dedicated", model=model, replica_urls=[])
    result = run_manage("reconcile_usage", *args)
    assert result.returncode != 0
    assert result.stderr.strip().startswith("CommandError:") and message in result.stderr
