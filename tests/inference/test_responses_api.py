"""``/v1/responses`` through the gateway on a real engine, with the official SDK: whole and
streamed (typed events), stored in PostgreSQL per tenant, retrieved, continued with
``previous_response_id`` on another web process and after a restart, deleted; another
tenant reaches none of it; what a chat completion cannot do is refused by name.

Outputs have a known length (``ignore_eos`` with ``max_output_tokens``) and the tiny model's
designed words (``devkit.tiny_model``: token k of every chat answer is ``word_at(k)``), so a
response's text, status, usage and ledger record are known before it runs."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import httpx
import openai
import pytest

from conversations.models import StoredResponse
from devkit.tiny_model import answer as scripted
from devkit.tiny_model import word_at
from tests.live import Stack, wait_for
from tests.moderation import test_moderation as moderation
from tests.serving import World

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

KNOWN = {"ignore_eos": True}  # the output runs to max_output_tokens, whatever it says


def _create(client: openai.OpenAI, *, extra: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """``responses.create`` of the tiny model, with vLLM's extras (``extra``) after KNOWN."""
    return client.responses.create(
        model="tiny-chat", extra_body={**KNOWN, **(extra or {})}, **kwargs
    )


def _chat_prompt_tokens(stack: Stack, key: str, messages: list[Any], **extra: Any) -> int:
    """The prompt tokens of the chat completion of ``messages`` (the same engine, the same
    template): what a response that reads that conversation must count."""
    answer = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": "tiny-chat", "messages": messages, "max_tokens": 1, **extra},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens"])


def test_a_response_whole_streamed_retrieved_continued_and_in_the_ledger(world: World) -> None:
    tenant, key = world.tenant()
    client = world.stack.openai(key)
    first = _create(client, input="Tell me about cats.", max_output_tokens=6)
    assert first.id.startswith("resp_") and len(first.id) > 40
    assert (first.status, first.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert first.usage.output_tokens == 6
    assert [item.type for item in first.output] == ["message"]
    assert first.output_text == first.output[0].content[0].text == scripted(6)

    # Streamed: the SDK's typed events, numbered, the text's deltas adding up to the result.
    with _create(
        client, input="And dogs?", max_output_tokens=5, stream=True, store=False
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == done.output_text == scripted(5) and done.usage.output_tokens == 5
    assert "response.output_text.done" in kinds and "response.output_item.done" in kinds

    # Stored: retrieved as answered; not stored (store=False): not there.
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)

    # Continued: the engine reads the whole conversation (the same prompt, token for token,
    # as the chat completion of those messages), and the instructions of this turn only.
    second = _create(
        client,
        input="Go on.",
        previous_response_id=first.id,
        instructions="Be brief.",
        max_output_tokens=3,
    )
    assert second.previous_response_id == first.id
    conversation = [
        {"role": "user", "content": "Tell me about cats."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Go on."},
    ]
    assert second.usage.input_tokens == _chat_prompt_tokens(
        world.stack, key, [{"role": "system", "content": "Be brief."}, *conversation]
    )
    third = _create(client, input="More.", previous_response_id=second.id, max_output_tokens=2)
    assert third.usage.input_tokens == _chat_prompt_tokens(
        world.stack,
        key,
        [
            *conversation,
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "More."},
        ],
    )
    items = [i.model_dump() for i in client.responses.input_items.list(second.id).data]
    assert [(i["type"], i["role"], i["content"][0]["text"]) for i in items] == [
        ("message", "user", "Go on.")
    ]

    # The ledger: one record a response, labelled so, with the tokens the client was told.
    told = {r.usage.input_tokens + r.usage.output_tokens for r in (first, done, second, third)}
    wait_for(lambda: len(world.records(tenant=tenant, endpoint="responses")) == 4, timeout=30)
    records = world.records(tenant=tenant, endpoint="responses")
    assert {r.prompt_tokens + r.completion_tokens for r in records} == told
    stored = StoredResponse.objects.get(id=third.id)
    assert stored.request_id in {r.request_id for r in records}

    # Deleted: gone for good.
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_another_tenant_reaches_none_of_a_tenant_s_responses(world: World) -> None:
    _, key_a = world.tenant()
    _, key_b = world.tenant()
    mine = _create(world.stack.openai(key_a), input="A secret.", max_output_tokens=2)
    theirs = world.stack.openai(key_b)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.input_items.list(mine.id)
    with pytest.raises(openai.BadRequestError) as continued:
        _create(theirs, input="What was it?", previous_response_id=mine.id, max_output_tokens=1)
    assert continued.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(mine.id)
    # Still the owner's, whole.
    assert world.stack.openai(key_a).responses.retrieve(mine.id).output_text == mine.output_text
    # Without a key, nothing at all.
    anonymous = httpx.get(f"{world.stack.url}/v1/responses/{mine.id}", timeout=10)
    assert anonymous.status_code == 401


def test_a_stored_response_continues_on_another_web_process_and_after_a_restart(
    world: World, serving_db_url: str, stack_factory: Any
) -> None:
    _, key = world.tenant()
    first = _create(world.stack.openai(key), input="Remember this.", max_output_tokens=3)
    other = stack_factory(serving_db_url, name="responses-other", celery=False)
    second = _create(
        other.openai(key), input="Go on.", previous_response_id=first.id, max_output_tokens=2
    )
    assert second.status == "incomplete"
    # That web process stops (SIGTERM, as a deploy does) and a new one starts.
    os.killpg(other.processes["web"].pid, signal.SIGTERM)
    other.processes["web"].wait(timeout=30)
    again = stack_factory(serving_db_url, name="responses-again", celery=False)
    client = again.openai(key)
    assert client.responses.retrieve(second.id).output_text == second.output_text
    third = _create(client, input="More.", previous_response_id=second.id, max_output_tokens=1)
    assert third.previous_response_id == second.id and third.usage.output_tokens == 1


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_tool"),
        (
            {"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
            "tools[0].type",
            "unsupported_tool",
        ),
        (
            {"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
            "tools[0].type",
            "unsupported_tool",
        ),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        (
            {"input": [{"type": "item_reference", "id": "msg_1"}]},
            "input[0].type",
            "unsupported_content",
        ),
        (
            {"previous_response_id": "resp_nope"},
            "previous_response_id",
            "previous_response_not_found",
        ),
        ({"max_output_tokens": 5000}, "max_output_tokens", None),  # past the model's context
    ],
)
def test_what_cannot_be_served_is_refused_by_name(
    world: World, extra: dict[str, Any], param: str, code: str | None
) -> None:
    _, key = world.tenant()
    body = {"model": "tiny-chat", "input": "hi", **extra}
    answer = httpx.post(
        f"{world.stack.url}/v1/responses",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"]


def test_a_function_call_and_its_output_reach_the_engine_as_the_conversation(
    world: World,
) -> None:
    """The client ran a function the model called: the call and its output, sent back as
    input items, are read by the engine as the assistant's tool call and the tool's answer
    (the same prompt as the chat completion of those messages). Whether an engine *makes*
    calls is its deployment's choice (vLLM needs a tool-call parser for the model); the
    items' translation is the gateway's."""
    _, key = world.tenant()
    client = world.stack.openai(key)
    tool = {
        "type": "function",
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    answered = _create(
        client,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=2,
    )
    assert answered.status == "incomplete" and answered.usage.output_tokens == 2
    tool_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    }
    prompt_tokens = _chat_prompt_tokens(
        world.stack,
        key,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}],
        tool_choice="none",
    )
    assert answered.usage.input_tokens == prompt_tokens
    listed = client.responses.input_items.list(answered.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "function_call", "function_call_output"]


def test_the_tenant_s_moderation_cuts_a_response_and_refuses_a_banned_input(
    world: World,
) -> None:
    """A response is moderated as the chat completion it runs as: the banned word the tiny
    model's script writes at token AT ends the answer before it (``incomplete``, for
    ``content_filter``), streamed or whole, and an input with it is refused unsent."""
    tenant, key = world.tenant()
    moderation._policy(tenant, deny_terms=[moderation.TERM], output_mode="hold")
    time.sleep(2.1)  # the promise: every web process has the policy within two seconds
    client = world.stack.openai(key)
    ask: dict[str, Any] = {
        "input": moderation.PROMPT[0]["content"],
        "max_output_tokens": moderation.LONG,
        "temperature": 0,
    }
    with _create(client, stream=True, **ask) as stream:
        events = list(stream)
    done = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert done.incomplete_details.reason == "content_filter"
    assert moderation.TERM.lower() not in done.output_text.lower()
    assert moderation.TEXT.startswith(done.output_text)  # the answer, up to the cut
    whole = _create(client, **ask)
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "content_filter")
    assert moderation.TERM.lower() not in whole.output_text.lower()
    assert done.usage.output_tokens < moderation.LONG // 2  # the engine was stopped
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, input=f"Say {moderation.TERM}.", max_output_tokens=2)
    assert refused.value.code == "content_policy_violation"


def test_a_response_that_ends_by_itself_is_completed(world: World) -> None:
    """A stop string (vLLM's extra, as on chat) ends the answer before its bound: the
    response is ``completed``, with the text before the stop word."""
    _, key = world.tenant()
    done = _create(
        world.stack.openai(key),
        input="Go.",
        max_output_tokens=50,
        extra={"stop": [" " + word_at(3)]},
    )
    assert (done.status, done.incomplete_details) == ("completed", None)
    assert done.completed_at is not None and done.output_text == scripted(3)
    assert done.output[0].status == "completed"


def test_deleted_listed_and_continued_as_openai_s(world: World) -> None:
    _, key = world.tenant()
    client = world.stack.openai(key)
    asked = [{"role": "user", "content": f"Item {i}."} for i in range(3)]
    made = _create(client, input=asked, max_output_tokens=1)
    first = client.responses.input_items.list(made.id, limit=2)
    assert [i.model_dump()["content"][0]["text"] for i in first.data] == ["Item 2.", "Item 1."]
    assert first.has_more
    rest = client.responses.input_items.list(made.id, limit=2, after=first.data[-1].id)
    assert [i.model_dump()["content"][0]["text"] for i in rest.data] == ["Item 0."]
    assert not rest.has_more
    # Not kept, or deleted: nothing to continue.
    unkept = _create(client, input="x", max_output_tokens=1, store=False)
    assert unkept.store is False
    headers = {"authorization": f"Bearer {key}"}
    deleted = httpx.delete(f"{world.stack.url}/v1/responses/{made.id}", headers=headers)
    assert deleted.json() == {"id": made.id, "object": "response", "deleted": True}
    for gone in (unkept.id, made.id):
        with pytest.raises(openai.BadRequestError) as refused:
            _create(client, input="more", previous_response_id=gone, max_output_tokens=1)
        assert refused.value.code == "previous_response_not_found"
    again = httpx.delete(f"{world.stack.url}/v1/responses/{made.id}", headers=headers)
    assert again.status_code == 404


def test_a_client_that_leaves_mid_stream_is_billed_what_was_made_and_nothing_is_kept(
    world: World,
) -> None:
    tenant, key = world.tenant()
    created = ""
    with _create(
        world.stack.openai(key), input="Long.", max_output_tokens=600, stream=True
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                created = event.item_id
                break
    assert created
    (record,) = wait_for(lambda: world.records(tenant=tenant), timeout=30)
    assert record.endpoint == "responses" and 0 < record.completion_tokens < 600
    assert not StoredResponse.objects.filter(tenant=tenant).exists()


def test_a_response_the_database_cannot_keep_is_still_answered(world: World) -> None:
    """PostgreSQL keeps no NUL in JSON text: the answer comes (it was made and billed) with
    ``store: false``, and the stream says why before its last event; nothing half-kept."""
    tenant, key = world.tenant()
    client = world.stack.openai(key)
    whole = _create(client, input="a\u0000b", max_output_tokens=2)
    assert whole.store is False and whole.usage.output_tokens == 2
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    with _create(client, input="a\u0000b", max_output_tokens=2, stream=True) as stream:
        events = list(stream)
    assert [e.type for e in events[-2:]] == ["error", "response.incomplete"]
    assert events[-1].response.store is False
    assert not StoredResponse.objects.filter(tenant=tenant).exists()
    wait_for(lambda: len(world.records(tenant=tenant)) == 2, timeout=30)
