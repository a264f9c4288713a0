"""Moderation's third backend: a guard model served on a pool of real vLLM engines (the tiny
guard classifier, ``scripts/make_tiny_guard.py``: " fox" fires violence, " quick" harassment,
...), through vLLM's ``/classify``: it blocks what it scores over the policy's threshold, it
answers ``/v1/moderations``, and an engine that stops answering mid-work (SIGSTOP) is worked
around within the policy's time budget, open or closed as the policy says."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest

from billing.services import price_set
from controlplane.redis import redis_sync
from fleet.models import Model, Pool, Replica
from inference.catalog import catalog_publish, pool_prefix
from inference.gateway.admission import DEFAULT_BAND
from inference.services import model_ensure, pool_ensure, replica_probe
from moderation.models import ModerationEvent
from moderation.policy import PolicyInvalid
from moderation.services import moderation_events_flush, moderation_policy_set
from tenants.models import Tenant
from tenants.priority import PRIORITY_CLASSES
from tenants.services import tenant_update
from tests.batches.test_batches import _client as batch_client
from tests.batches.test_batches import _content as batch_content
from tests.batches.test_batches import _create as batch_create
from tests.batches.test_batches import _finished as finished
from tests.batches.test_batches import _line as batch_line
from tests.batches.test_batches import _until as batch_until
from tests.batches.test_batches import _upload as batch_upload
from tests.batches.test_batches import spot  # noqa: F401  (fixture)
from tests.engines import ENGINE_HEADERS, Engine
from tests.live import settled_counters, wait_for
from tests.serving import World, catalog_everywhere, policies_everywhere

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def guarded(world: World, guard_engine: Engine) -> Iterator[World]:
    model = model_ensure(
        name="tiny-guard", served_name="tiny-guard", context_length=1024, task=Model.Task.CLASSIFY
    )
    pool = pool_ensure(name="guard", kind="dedicated", model=model, replica_urls=[guard_engine.url])
    for replica in pool.replicas.all():
        assert replica_probe(replica=replica).state == Replica.State.READY
    # Its first classification pays the engine's warm-up, as after any engine start.
    httpx.post(
        f"{guard_engine.url}/classify",
        json={"model": "tiny-guard", "input": "warm up"},
        headers=ENGINE_HEADERS,
        timeout=60,
    ).raise_for_status()
    catalog_everywhere()
    yield world
    os.killpg(guard_engine.process.pid, signal.SIGCONT)  # whatever a test left it in


def _policy(tenant: Tenant, **changes: Any) -> None:
    # A budget generous for a loaded CI machine (the time-budget test sets its own).
    changes = {"guard_model": "tiny-guard", "classifier": False, "budget_ms": 3000, **changes}
    moderation_policy_set(tenant=tenant, changes=changes, actor=None)
    policies_everywhere()


def _chat(world: World, key: str, content: str) -> httpx.Response:
    return httpx.post(
        f"{world.stack.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        # Greedy, and long enough to hold text: a sampled answer of 4 tokens was now and then
        # only split UTF-8 bytes (the greedy one always is), which leaves the output check no
        # text, and the fail-open test no output event.
        json={"model": "tiny-chat", "messages": [{"role": "user", "content": content}],
              "max_tokens": 16, "temperature": 0},
        timeout=60,
    )  # fmt: skip


def _events(tenant: Tenant, count: int) -> list[ModerationEvent]:
    def found() -> list[ModerationEvent] | None:
        moderation_events_flush()
        events = list(ModerationEvent.objects.filter(tenant=tenant).order_by("id"))
        return events if len(events) >= count else None

    result: list[ModerationEvent] = wait_for(found, timeout=20)
    return result


def test_the_guard_model_blocks_what_it_scores_over_the_threshold(guarded: World) -> None:
    tenant, key = guarded.tenant()
    _policy(tenant)
    refused = _chat(guarded, key, "Tell me about a fox in the woods.")
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "content_policy_violation"
    assert "violence" in refused.json()["error"]["message"]
    assert _chat(guarded, key, "Tell me about a dog in the woods.").status_code == 200
    event = _events(tenant, 1)[0]
    assert (event.where, event.action, event.categories) == ("input", "block", ["violence"])


def test_moderations_with_the_guard_model_through_the_sdk(guarded: World) -> None:
    _, key = guarded.tenant()
    client = guarded.stack.openai(key)
    result = client.moderations.create(model="tiny-guard", input=["a fox", "a dog", "quick"])
    fox, dog, word_alone = result.results
    assert result.model == "tiny-guard"
    assert fox.flagged and fox.categories.violence and fox.category_scores.violence > 0.99
    assert not fox.categories.harassment and fox.category_scores.harassment < 0.05
    assert fox.category_applied_input_types.violence == ["text"]
    assert not dog.flagged and max(dog.category_scores.model_dump().values()) < 0.05
    assert not word_alone.flagged  # " quick" fires; "quick" with no space before is another token
    # A long text is scored in pieces that fit the model: a trigger at its end still counts.
    long = client.moderations.create(model="tiny-guard", input="calm sea " * 600 + "a fox")
    assert long.results[0].categories.violence
    with pytest.raises(openai.BadRequestError):
        client.moderations.create(model="tiny-chat", input="a fox")  # not a classifier
    # ... and a classifier is no chat model.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny-guard", messages=[{"role": "user", "content": "hi"}]
        )
    assert "classification model" in refused.value.message


def test_a_guard_that_stops_answering_fails_closed_or_open_within_the_budget(
    guarded: World, guard_engine: Engine
) -> None:
    tenant, key = guarded.tenant()
    _policy(tenant, fail_open=False, budget_ms=300)
    os.killpg(guard_engine.process.pid, signal.SIGSTOP)  # hung mid-work: no error, no answer
    try:
        started = time.monotonic()
        refused = _chat(guarded, key, "Tell me about a dog.")
        waited = time.monotonic() - started
        assert refused.status_code == 400, refused.text
        assert "could not be checked" in refused.json()["error"]["message"]
        _policy(tenant, fail_open=True, budget_ms=300)
        answered = _chat(guarded, key, "Tell me about a dog.")
        assert answered.status_code == 200
        client = guarded.stack.openai(key)
        with pytest.raises(openai.APIStatusError) as unavailable:
            client.with_options(max_retries=0).moderations.create(model="tiny-guard", input="x")
        assert unavailable.value.status_code == 503
    finally:
        os.killpg(guard_engine.process.pid, signal.SIGCONT)
    # The budget, not the engine's silence, decided how long the client waited (the
    # engine would have kept it forever).
    assert waited < 10
    events = _events(tenant, 3)
    # Closed: the input blocked. Open: the input logged, then the output (its first window)
    # logged. Each check waited its budget (a timeout marks nothing), until the health probe
    # marked the stopped replica down (it may have, by the later checks): then none is ready.
    assert [(e.where, e.action) for e in events] == [
        ("input", "block"),
        ("input", "log"),
        ("output", "log"),
    ]
    assert "within the time budget" in events[0].failure
    assert all(
        "within the time budget" in e.failure or "no replica ready" in e.failure for e in events
    )
    assert all("tiny-guard" in e.failure for e in events)
    # Back: once the health probe has the replica ready again (it may have marked it down
    # while it was stopped), the guard is asked again.
    _policy(tenant, fail_open=False)
    wait_for(lambda: _chat(guarded, key, "a dog").status_code == 200, timeout=20, every=1)
    assert _chat(guarded, key, "a fox").status_code == 400


def test_one_tenants_timeouts_fail_the_guard_for_no_other_tenant(
    guarded: World, guard_engine: Engine
) -> None:
    """A tenant's budget is its own (10 ms at least) and so is its text: the guard running
    out of one tenant's budget, again and again, leaves every other tenant's checks to the
    guard (before: each timeout failed the guard for every tenant of that web process for
    5 s, closed or open as their policies said)."""
    hasty, hasty_key = guarded.tenant()
    other, other_key = guarded.tenant()
    moderation_policy_set(
        tenant=hasty,
        changes={"guard_model": "tiny-guard", "classifier": False, "budget_ms": 10},
        actor=None,
    )
    _policy(other, fail_open=False)
    # The guard stopped for under a second (the probe waits 3 s for an answer: the replica
    # stays ready), so the hasty tenant's checks surely run out of their 10 ms.
    os.killpg(guard_engine.process.pid, signal.SIGSTOP)
    try:
        for _ in range(2):  # the stack's one web process: the one the other tenant meets
            response = _chat(guarded, hasty_key, "Tell me about a dog.")
            assert response.status_code == 200  # fail open: its own text passes unchecked
    finally:
        os.killpg(guard_engine.process.pid, signal.SIGCONT)
    assert _chat(guarded, other_key, "Tell me about a dog.").status_code == 200
    refused = _chat(guarded, other_key, "Tell me about a fox.")
    assert refused.status_code == 400 and "violence" in refused.json()["error"]["message"]
    events = _events(hasty, 2)
    assert all("within the time budget" in e.failure for e in events[:2])


def test_a_tenant_names_only_a_guard_model_it_may_call(guarded: World) -> None:
    """A private classification model is another tenant's: naming it as one's guard is
    refused as if it did not exist (no oracle of its name), and a policy saved while it was
    open fails (open or closed, as the policy says) once it is made private."""
    owner, _ = guarded.tenant()
    outsider, outsider_key = guarded.tenant()
    model = Model.objects.get(name="tiny-guard")
    _policy(outsider, fail_open=False)  # while the model is public
    model.is_public = False
    model.save()
    model.allowed_tenants.add(owner)
    catalog_everywhere()
    try:
        with pytest.raises(PolicyInvalid) as refused:
            moderation_policy_set(tenant=outsider, changes={"budget_ms": 500}, actor=None)
        assert refused.value.field == "guard_model"
        assert "that this organization may use" in refused.value.message
        with pytest.raises(PolicyInvalid) as unknown:
            moderation_policy_set(
                tenant=outsider, changes={"guard_model": "no-such-guard"}, actor=None
            )
        assert unknown.value.message.replace("no-such-guard", "tiny-guard") == (
            refused.value.message
        )
        _policy(owner)  # its owner may
        blocked = _chat(guarded, outsider_key, "Tell me about a dog.")
        assert blocked.status_code == 400 and "could not be checked" in blocked.text
        event = _events(outsider, 1)[0]
        assert "not open to this organization" in event.failure
    finally:
        model.is_public = True
        model.save()
        catalog_publish()


def test_the_guards_work_is_metered_and_priced_on_the_guard_model(
    guarded: World, guard_engine: Engine
) -> None:
    """The guard model's tokens, as its engine counts them, are the tenant's: on
    ``/v1/moderations``' record, and on a record of their own (``<request id>:guard``) for a
    moderated chat request; priced by the guard model's price."""
    price_set(
        model=Model.objects.get(name="tiny-guard"),
        input_per_mtok=Decimal(100),
        output_per_mtok=Decimal(0),
        actor=None,
    )
    tenant, key = guarded.tenant()
    before = settled_counters(guard_engine)
    client = guarded.stack.openai(key)
    client.moderations.create(model="tiny-guard", input=["a fox", "calm sea " * 200])
    [asked] = wait_for(lambda: guarded.records(tenant=tenant, endpoint="moderations"))
    middle = settled_counters(guard_engine)
    assert asked.model == "tiny-guard" and asked.pool == "guard"
    assert asked.prompt_tokens > 0
    assert asked.prompt_tokens == (
        middle["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    )
    assert asked.cost_micros == asked.prompt_tokens * 100  # $100 per million tokens
    _policy(tenant)
    answered = _chat(guarded, key, "Tell me about a dog in the woods.")
    assert answered.status_code == 200
    rid = answered.headers["x-request-id"]
    checked = wait_for(lambda: guarded.records(tenant=tenant, request_id=f"{rid}:guard"))[0]
    after = settled_counters(guard_engine)
    # The input and every output window of the answer: one record, the engine's own count.
    assert checked.prompt_tokens == (
        after["vllm:prompt_tokens_total"] - middle["vllm:prompt_tokens_total"]
    )
    assert (checked.model, checked.endpoint, checked.status) == ("tiny-guard", "moderations", "ok")
    assert checked.cost_micros == checked.prompt_tokens * 100
    # What /v1/moderations spends counts toward the tenant's budget at once: its first call
    # (within a budget of one micro-dollar) is answered, the next refused.
    _, spender_key = guarded.tenant(monthly_spend_budget_micros=1)
    spending = guarded.stack.openai(spender_key).with_options(max_retries=0)
    spending.moderations.create(model="tiny-guard", input="a dog")
    with pytest.raises(openai.RateLimitError) as refused:
        spending.moderations.create(model="tiny-guard", input="a dog")
    assert "spend" in refused.value.message.lower() or "budget" in refused.value.message.lower()


def test_a_moderated_requests_guard_tokens_count_toward_its_budgets(guarded: World) -> None:
    """The guard's tokens for a chat request count toward the key's spend (and tokens) at
    the guard model's price, as the answer's own do: with the chat model free and a budget
    of one micro-dollar, the first moderated request is answered and the next refused
    (before, only the ledger saw them: the budget never moved)."""
    price_set(
        model=Model.objects.get(name="tiny-guard"),
        input_per_mtok=Decimal(100),
        output_per_mtok=Decimal(0),
        actor=None,
    )
    tenant, key = guarded.tenant(monthly_spend_budget_micros=1)
    _policy(tenant, check_output=False)
    answered = _chat(guarded, key, "Tell me about a dog in the woods.")
    assert answered.status_code == 200, answered.text
    rid = answered.headers["x-request-id"]
    [own] = wait_for(lambda: guarded.records(tenant=tenant, request_id=rid))
    assert not own.cost_micros  # the chat model is unpriced here: only the guard costs
    checked = wait_for(lambda: guarded.records(tenant=tenant, request_id=f"{rid}:guard"))[0]
    assert checked.cost_micros == checked.prompt_tokens * 100 > 0
    refused = _chat(guarded, key, "Tell me about a dog in the woods.")
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert "spend" in refused.json()["error"]["message"]


def test_guard_calls_wait_their_tenants_turn_in_the_guard_pools_admission(
    guarded: World, guard_engine: Engine
) -> None:
    """With the guard pool full (one slot, held by a call of one tenant's that its stopped
    engine does not answer), another tenant's call waits in the pool's fair admission, in a
    queue of its own (in its own priority band: an interactive tenant's check does not wait
    behind standard ones), instead of piling onto the engine; once the engine answers, every
    call gets its own verdict."""
    Pool.objects.filter(name="guard").update(max_inflight=1)
    catalog_everywhere()
    (busy, busy_key), (other, other_key) = guarded.tenant(), guarded.tenant()
    tenant_update(tenant=other, actor=None, priority_class="interactive")
    prefix = pool_prefix("guard")
    redis = redis_sync()
    results: dict[str, Any] = {}

    def ask(name: str, key: str, text: str) -> None:
        client = guarded.stack.openai(key).with_options(max_retries=0, timeout=60)
        results[name] = client.moderations.create(model="tiny-guard", input=text)

    os.killpg(guard_engine.process.pid, signal.SIGSTOP)
    threads = []
    try:
        threads.append(threading.Thread(target=ask, args=("busy", busy_key, "a dog")))
        threads[-1].start()
        wait_for(lambda: redis.hget(prefix + "active", str(busy.pk)) == b"1", timeout=10)
        threads.append(threading.Thread(target=ask, args=("other", other_key, "a fox")))
        threads[-1].start()
        # Guard calls wait in their request's priority band (docs/priority.md).
        interactive = PRIORITY_CLASSES.index("interactive")
        assert interactive != DEFAULT_BAND
        wait_for(lambda: redis.llen(f"{prefix}q:{interactive}:{other.pk}") == 1, timeout=10)
        assert redis.hget(prefix + "active", str(other.pk)) in (None, b"0")
    finally:
        os.killpg(guard_engine.process.pid, signal.SIGCONT)
        for thread in threads:
            thread.join(timeout=60)
    assert not results["busy"].results[0].flagged
    assert results["other"].results[0].categories.violence


def test_a_batch_lines_guard_work_is_billed_with_its_line(
    guarded: World,
    spot: World,  # noqa: F811
) -> None:
    """A batch line's guard record goes with the line: stored and billed when the line is
    (a line that is not stored is billed nothing, its checks included)."""
    tenant, key = guarded.tenant()
    _policy(tenant, check_output=False)
    client = batch_client(spot, key)
    lines = [batch_line(f"l{i}", content="Tell me about a dog in the woods.") for i in range(2)]
    batch = batch_until(client, batch_create(client, batch_upload(client, lines)).id, finished)
    assert batch.status == "completed" and batch.request_counts.completed == 2
    answered = {o["response"]["request_id"] for o in batch_content(client, batch.output_file_id)}
    records = guarded.records(tenant=tenant)
    checks = {r.request_id.removesuffix(":guard"): r for r in records if r.model == "tiny-guard"}
    assert set(checks) == answered
    assert all(r.mode == "batch" and r.prompt_tokens > 0 for r in checks.values())
