"""The answers' shapes (inference/gateway/responses.py), for what the tiny CPU model cannot make
the engine produce: tool calls. The chunks are what vLLM streams for a tool call (an id, type
and name first, then the arguments in pieces, then finish_reason "tool_calls"); the
assembled answer and each cleaned chunk must match OpenAI's schema."""

from __future__ import annotations

import json
from typing import Any

from inference.gateway.responses import Whole, clean
from tests import contract


def _chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "internal-name",
        "prompt_token_ids": None,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
                "token_ids": None,
                **choice,
            }
        ],
    }


TOOL_CALL = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk(
        {
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-9",
                    "type": "function",
                    "index": 0,
                    "function": {"name": "pick", "arguments": ""},
                }
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"colour": '}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"red"}'}}]}),
    _chunk({}, "tool_calls", stop_reason=None),
]
USAGE = {"prompt_tokens": 8, "completion_tokens": 9, "total_tokens": 17}


def test_a_streamed_tool_call_is_openais_chunk_by_chunk() -> None:
    for raw in json.loads(json.dumps(TOOL_CALL)):
        clean(raw, "tiny-chat", chat=True)
        assert raw["model"] == "tiny-chat" and "prompt_token_ids" not in raw
        contract.validate("CreateChatCompletionStreamResponse", raw)


def test_a_tool_call_assembled_is_openais_completion() -> None:
    whole = Whole(chat=True)
    for raw in json.loads(json.dumps(TOOL_CALL)):
        clean(raw, "tiny-chat", chat=True)
        whole.add(raw)
    answer = whole.result(model="tiny-chat", fallback_id="x", created=1, usage=USAGE)
    contract.validate("CreateChatCompletionResponse", answer)
    message = answer["choices"][0]["message"]
    assert message["content"] is None and message["refusal"] is None
    assert message["tool_calls"] == [
        {
            "id": "chatcmpl-tool-9",
            "type": "function",
            "function": {"name": "pick", "arguments": '{"colour": "red"}'},
        }
    ]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_logprobs_carry_refusal_null() -> None:
    token = {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []}
    raw = _chunk({"content": "a"})
    raw["choices"][0]["logprobs"] = {"content": [token]}
    clean(raw, "tiny-chat", chat=True)
    contract.validate("CreateChatCompletionStreamResponse", raw)
    whole = Whole(chat=True)
    whole.add(raw)
    whole.add(_chunk({}, "length"))
    answer = whole.result(model="tiny-chat", fallback_id="x", created=1, usage=USAGE)
    contract.validate("CreateChatCompletionResponse", answer)
    assert answer["choices"][0]["logprobs"] == {"content": [token], "refusal": None}
