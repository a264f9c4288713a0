"""The Responses API's translation (``inference.gateway.responses_in`` and ``responses_out``),
no engine: a request's items into chat messages, and a chat completion's chunks into the
typed events of OpenAI's stream (reasoning, text and function calls), each event and the final
response checked against OpenAI's published schema. The live path, on a real engine, is
test_responses_api.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inference.gateway import responses_in, responses_out
from inference.gateway.errors import ApiError
from tests import contract


def _chunk(**delta: Any) -> dict[str, Any]:
    finish = delta.pop("finish_reason", None)
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _stream(chunks: list[dict[str, Any]], **request: Any) -> list[dict[str, Any]]:
    body = {"model": "tiny-chat", "input": "hi", **request}
    events = responses_out.EventStream(
        responses_out.skeleton(body, response_id="resp_1", created_at=1)
    )
    out = events.begin()
    for chunk in chunks:
        out.extend(events.feed(chunk))
    closing, response = events.close(chat_usage={"prompt_tokens": 3, "completion_tokens": 4})
    out.extend([*closing, *events.terminal(response)])
    for event in out:  # each one as OpenAI's schema declares it
        assert contract.errors("ResponseStreamEvent", event) == [], event
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_reasoning_then_text_then_function_calls_stream_as_openai_s_items() -> None:
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
    events = _stream(
        [
            _chunk(role="assistant", reasoning_content="Think"),
            _chunk(reasoning_content="ing."),
            _chunk(content="Let me "),
            _chunk(content="check."),
            _chunk(tool_calls=[{"index": 0, "id": "call_a", "function": {"name": "weather"}}]),
            _chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city":'}}]),
            _chunk(tool_calls=[{"index": 0, "function": {"arguments": ' "Paris"}'}}]),
            _chunk(tool_calls=[{"index": 1, "id": "call_b", "function": {"name": "weather"}}]),
            _chunk(tool_calls=[{"index": 1, "function": {"arguments": "{}"}}]),
            _chunk(finish_reason="tool_calls"),
        ],
        tools=[tool],
    )
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    response = events[-1]["response"]
    assert contract.errors("Response", response) == []
    output = response["output"]
    assert [i["type"] for i in output] == ["reasoning", "message", "function_call", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert output[1]["content"][0]["text"] == "Let me check."
    assert [(i["call_id"], i["name"], i["arguments"]) for i in output[2:]] == [
        ("call_a", "weather", '{"city": "Paris"}'),
        ("call_b", "weather", "{}"),
    ]
    assert all(i["status"] == "completed" for i in output)
    assert response["usage"]["total_tokens"] == 7
    # What the next turn reads: the text and the calls, not the reasoning.
    assert responses_out.assistant_turn(output) == [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{}"},
                },
            ],
        }
    ]


@pytest.mark.parametrize(
    ("finish", "status", "reason"),
    [
        ("length", "incomplete", "max_output_tokens"),
        ("content_filter", "incomplete", "content_filter"),
        ("stop", "completed", None),
    ],
)
def test_how_the_answer_ended_is_the_response_s_status(
    finish: str, status: str, reason: str | None
) -> None:
    events = _stream([_chunk(content="a"), _chunk(finish_reason=finish)])
    response = events[-1]["response"]
    assert response["status"] == status
    assert (response["incomplete_details"] or {}).get("reason") == reason
    assert response["output"][0]["status"] == (
        "completed" if status == "completed" else "incomplete"
    )


def test_an_answer_with_nothing_in_it_is_an_empty_message_and_a_failure_says_why() -> None:
    events = _stream([_chunk(finish_reason="stop")])
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""
    body = {"model": "tiny-chat", "input": "hi"}
    stream = responses_out.EventStream(
        responses_out.skeleton(body, response_id="resp_2", created_at=1)
    )
    stream.begin()
    stream.feed(_chunk(content="half"))
    closing, response = stream.close(chat_usage={}, error="the engine failed")
    ending = [*closing, *stream.terminal(response, problem=("storage_failed", "not kept"))]
    assert [e["type"] for e in ending[-2:]] == ["error", "response.failed"]
    assert [e["sequence_number"] for e in ending] == list(range(5, 5 + len(ending)))
    assert response["error"] == {"code": "server_error", "message": "the engine failed"}
    assert contract.errors("Response", response) == []


def test_the_input_becomes_the_conversation_and_the_instructions_stay_out_of_it() -> None:
    history = [{"role": "user", "content": "Earlier."}, {"role": "assistant", "content": "Yes."}]
    translated = responses_in.translate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "reasoning", "summary": []},
            ],
            "max_output_tokens": 7,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "f"},
        },
        history,
        max_bytes=1 << 20,
    )
    chat = translated.chat
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert translated.conversation == chat["messages"][1:]
    assert translated.conversation[:2] == history
    assert translated.conversation[2] == {"role": "developer", "content": "Rules."}
    # Two calls of one turn are one assistant message; the output answers the first.
    assert [c["id"] for c in translated.conversation[3]["tool_calls"]] == ["c1", "c2"]
    assert translated.conversation[4] == {"role": "tool", "tool_call_id": "c1", "content": "one"}
    assert len(translated.conversation) == 5  # reasoning is not read again
    assert chat["max_tokens"] == 7
    assert chat["response_format"]["json_schema"]["name"] == "x"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["tools"][0]["function"]["name"] == "f"
    assert [i["type"] for i in translated.input_items] == [
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "reasoning",
    ]
    assert len({i["id"] for i in translated.input_items}) == 5


# A stored conversation past what one request may carry (4096 bytes here).
HISTORY = [{"role": "user", "content": "y" * 5000}]
DEEP: dict[str, Any] = {}
_node = DEEP
for _ in range(300):  # orjson reads 1024 levels and writes 255
    _node["a"] = {}
    _node = _node["a"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (
            {"input": "x", "tools": [{"type": "web_search_preview"}]},
            "tools[0].type",
            "unsupported_tool",
        ),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "unsupported_tool"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        (
            {"input": "x", "include": ["reasoning.encrypted_content"]},
            "include",
            "unsupported_parameter",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
            "unsupported_content",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", None),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", None),
        ({"input": []}, "input", None),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", None),
        ({"input": "x", "temperature": 3}, "temperature", None),
        ({"input": "x", "surprise": 1}, "surprise", None),
        ({}, "input", None),
        ({"input": "x", "text": {"format": "x"}}, "text.format", None),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type", None),
        ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name", None),
        ({"input": "x" * 5000}, "input", "request_too_large"),
        (
            {"input": "x", "previous_response_id": "resp_1"},
            "previous_response_id",
            "request_too_large",
        ),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": DEEP}]},
            None,
            None,
        ),
    ],
)
def test_what_a_chat_completion_cannot_carry_is_refused_by_name(
    body: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(ApiError) as refused:
        # json, not orjson: it writes the 300 levels the gateway must refuse to send on.
        request = responses_in.read_request(json.dumps({"model": "tiny-chat", **body}).encode())
        responses_in.translate(
            request, HISTORY if "previous_response_id" in body else [], max_bytes=4096
        )
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, code)
    assert refused.value.message


def test_a_whole_answer_is_the_same_response_as_its_stream() -> None:
    answer = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    output, finish = responses_out.output_of_answer(answer)
    body = {"model": "m", "input": "hi"}
    response = responses_out.finished(
        responses_out.skeleton(body, response_id="resp_3", created_at=1),
        output=output,
        finish_reason=finish,
        chat_usage={"prompt_tokens": 1, "completion_tokens": 2},
    )
    assert contract.errors("Response", response) == []
    assert [i["type"] for i in response["output"]] == ["function_call"]
    assert response["status"] == "completed" and json.loads(output[0]["arguments"]) == {}


def test_each_item_is_closed_before_the_next_opens() -> None:
    """As OpenAI's stream: a client that renders items as they come never sees two open."""
    events = _stream(
        [
            _chunk(content="Calling."),
            _chunk(
                tool_calls=[{"index": 0, "id": "a", "function": {"name": "f", "arguments": "{}"}}]
            ),
            _chunk(
                tool_calls=[{"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}}]
            ),
            _chunk(finish_reason="tool_calls"),
        ]
    )
    opened: set[str] = set()
    for event in events:
        if event["type"] == "response.output_item.added":
            assert not opened, event
            opened.add(event["item"]["id"])
        elif event["type"] == "response.output_item.done":
            opened.discard(event["item"]["id"])
    assert not opened


def test_reasoning_items_sent_back_get_ids_of_their_own() -> None:
    """The input items are paged by id: a client's ids (repeated, or not strings) are not."""
    translated = responses_in.translate(
        {"model": "m", "input": [{"type": "reasoning", "id": 7, "summary": []}] * 2},
        [],
        max_bytes=4096,
    )
    ids = [item["id"] for item in translated.input_items]
    assert len(set(ids)) == 2 and all(isinstance(i, str) and i.startswith("rs_") for i in ids)


def test_null_is_the_default() -> None:
    """``store: null`` stores, as OpenAI (the default), and null sampling fields echo theirs."""
    response = responses_out.skeleton(
        {"model": "m", "input": "x", "store": None, "temperature": None, "tool_choice": None},
        response_id="resp_4",
        created_at=1,
    )
    assert (response["store"], response["temperature"], response["tool_choice"]) == (
        True,
        1.0,
        "auto",
    )
