"""The engine's answers reshaped to OpenAI's: each streamed chunk as it passes (``clean``),
the non-streamed answer assembled from the stream (``Whole``), and an answer the engine gave
whole (``whole_answer``, a batch line's) in the same shape.

The shapes are OpenAI's published schema (the tests check every answer against it, see
tests/contract): required keys are always present, ``null`` where OpenAI sends ``null`` —
a chat message's ``refusal``, a chat logprobs object's ``refusal`` — and vLLM's internal
fields are dropped. Fields vLLM adds that clients may use (``stop_reason``,
``reasoning_content``) stay: the schema allows additional fields.
"""

from __future__ import annotations

from typing import Any

import orjson
from django.conf import settings

from inference.gateway.errors import ApiError

# Fields vLLM adds to OpenAI's chunk shape that are its own business.
_EXTRA_TOP = ("prompt_token_ids", "prompt_text", "kv_transfer_params")
_EXTRA_CHOICE = ("token_ids",)


def clean(chunk: dict[str, Any], model: str, chat: bool) -> list[dict[str, Any]] | None:
    """One engine chunk (usage already taken out) in OpenAI's shape, in place, under the
    public model name; returns its choices (None or empty for the engine's usage chunk)."""
    for name in _EXTRA_TOP:
        chunk.pop(name, None)
    chunk["model"] = model
    choices: list[dict[str, Any]] | None = chunk.get("choices")
    if choices:
        for choice in choices:
            for name in _EXTRA_CHOICE:
                choice.pop(name, None)
            if chat:
                logprobs = choice.get("logprobs")
                if logprobs is not None and "refusal" not in logprobs:
                    logprobs["refusal"] = None
    return choices


class ResponseTooLarge(Exception):
    """A non-streamed answer grew past INFERPLANE_MAX_RESPONSE_BYTES."""


def answer_limit(mode: str) -> int:
    """The most bytes a non-streamed answer may have: a batch line's is held in a worker with
    many others (``INFERPLANE_BATCH_MAX_ANSWER_BYTES``), an online one alone."""
    if mode == "batch":
        return min(
            settings.INFERPLANE_BATCH_MAX_ANSWER_BYTES, settings.INFERPLANE_MAX_RESPONSE_BYTES
        )
    return int(settings.INFERPLANE_MAX_RESPONSE_BYTES)


def too_slow(seconds: int) -> ApiError:
    """A whole answer the engine did not finish in time; the replica is not blamed."""
    return ApiError(
        504,
        f"The engine did not finish the answer within {seconds} s. Ask for less (max_tokens, "
        "n) or stream it.",
        type="server_error",
        code="timeout",
    )


def too_large(limit: int) -> ApiError:
    """What the client is told about a non-streamed answer larger than ``limit`` bytes."""
    return ApiError(
        400,
        f"The response grew past {limit} bytes before it was complete. Ask for it with "
        "stream=true, or lower max_tokens, n or logprobs.",
        code="response_too_large",
    )


_MESSAGE_FIELDS = ("role", "content", "reasoning_content", "reasoning", "refusal")


def embeddings_answer(answer: dict[str, Any], *, model: str, prompt_tokens: int) -> dict[str, Any]:
    """An engine's embeddings in OpenAI's shape: the name the client asked for, and the
    engine's own count of the prompt tokens (the tokens billed). Each vector is passed as
    the engine wrote it (floats, or base64 when asked)."""
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": item.get("index", i),
                "embedding": item.get("embedding"),
            }
            for i, item in enumerate(answer.get("data") or ())
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def whole_answer(
    answer: dict[str, Any], *, chat: bool, model: str, usage: dict[str, Any]
) -> dict[str, Any]:
    """An engine's non-streamed answer in the shape ``Whole.result`` gives a streamed one:
    the same fields (vLLM's own left out), so a batch line's body and an online answer
    look alike."""
    choices = []
    for c in answer.get("choices") or ():
        choice: dict[str, Any] = {
            "index": c.get("index", 0),
            "logprobs": c.get("logprobs"),
            "finish_reason": c.get("finish_reason"),
        }
        if c.get("stop_reason") is not None:
            choice["stop_reason"] = c["stop_reason"]
        if chat:
            given = c.get("message") or {}
            message = {k: given[k] for k in _MESSAGE_FIELDS if given.get(k) is not None}
            message.setdefault("role", "assistant")
            if given.get("tool_calls"):
                message["tool_calls"] = given["tool_calls"]
                message["content"] = message.get("content") or None  # as OpenAI: null
            else:
                message.setdefault("content", "")
            message.setdefault("refusal", None)
            choice["message"] = message
            logprobs = choice["logprobs"]
            if logprobs is not None and "refusal" not in logprobs:
                logprobs["refusal"] = None
        else:
            choice["text"] = c.get("text") or ""
        choices.append(choice)
    return {
        "id": answer.get("id", ""),
        "object": "chat.completion" if chat else "text_completion",
        "created": answer.get("created", 0),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


class Whole:
    """The non-streamed response, assembled from the engine's stream as it comes: text in
    parts joined once at the end, never the chunks themselves, and never more than
    ``INFERPLANE_MAX_RESPONSE_BYTES`` (an answer that grows past it raises
    ResponseTooLarge: ``stream=true`` is the way to ask for it). Chunks come in cleaned."""

    def __init__(self, *, chat: bool, limit: int | None = None) -> None:
        self.chat = chat
        self.id = ""
        self.created = 0
        self.choices: dict[int, dict[str, Any]] = {}
        self.texts: dict[tuple[int, str], list[str]] = {}
        self.size = 0
        self.limit = limit or settings.INFERPLANE_MAX_RESPONSE_BYTES
        self.moderation: dict[str, Any] | None = None  # what a flagging policy found

    def add(self, chunk: dict[str, Any]) -> None:
        if "moderation" in chunk:  # the moderation chunk of a flagged answer
            self.moderation = chunk["moderation"]
        if not self.id:
            self.id, self.created = chunk.get("id", ""), chunk.get("created", 0)
        for c in chunk.get("choices") or ():
            index = c.get("index", 0)
            choice = self.choices.get(index)
            if choice is None:
                choice = self.choices[index] = {
                    "index": index,
                    "logprobs": None,
                    "finish_reason": None,
                    **({"message": {"role": "assistant"}} if self.chat else {}),
                }
            if self.chat:
                self._merge_delta(index, choice, c)
            else:
                self._text(index, "text", c.get("text"))
                if c.get("logprobs"):
                    self._grow(c["logprobs"])
                    logprobs = choice["logprobs"] or {
                        "tokens": [],
                        "token_logprobs": [],
                        "top_logprobs": [],
                        "text_offset": [],
                    }
                    for name in logprobs:
                        logprobs[name].extend(c["logprobs"].get(name) or [])
                    choice["logprobs"] = logprobs
            if c.get("finish_reason"):
                choice["finish_reason"] = c["finish_reason"]
            if c.get("stop_reason") is not None:
                choice["stop_reason"] = c["stop_reason"]

    def _grow(self, part: Any) -> None:
        self.size += len(part) if isinstance(part, str) else len(orjson.dumps(part))
        if self.size > self.limit:
            raise ResponseTooLarge(self.limit)

    def _text(self, index: int, name: str, value: str | None) -> None:
        if value:
            self._grow(value)
            self.texts.setdefault((index, name), []).append(value)

    def _merge_delta(self, index: int, choice: dict[str, Any], c: dict[str, Any]) -> None:
        delta = c.get("delta") or {}
        message = choice["message"]
        if delta.get("role"):
            message["role"] = delta["role"]
        for text_field in ("content", "reasoning_content", "reasoning", "refusal"):
            if delta.get(text_field) is not None:
                self.texts.setdefault((index, text_field), [])
                self._text(index, text_field, delta[text_field])
        for call in delta.get("tool_calls") or ():
            self._grow(call)
            calls = message.setdefault("tool_calls", [])
            position = call.get("index", len(calls))
            while len(calls) <= position:
                calls.append(
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
            target = calls[position]
            if call.get("id"):
                target["id"] = call["id"]
            if call.get("type"):
                target["type"] = call["type"]
            function = call.get("function") or {}
            if function.get("name"):
                target["function"]["name"] += function["name"]
            if function.get("arguments"):
                target["function"]["arguments"] += function["arguments"]
        if c.get("logprobs") and c["logprobs"].get("content"):
            self._grow(c["logprobs"]["content"])
            logprobs = choice["logprobs"] or {"content": [], "refusal": None}
            logprobs["content"].extend(c["logprobs"]["content"])
            choice["logprobs"] = logprobs

    def result(
        self, *, model: str, fallback_id: str, created: int, usage: dict[str, Any]
    ) -> dict[str, Any]:
        for (index, name), parts in self.texts.items():
            target = self.choices[index]["message"] if self.chat else self.choices[index]
            target[name] = "".join(parts)
        for choice in self.choices.values():
            if self.chat:
                message = choice["message"]
                if message.get("tool_calls"):
                    message["content"] = message.get("content") or None  # as OpenAI: null
                elif message.get("content") is None:
                    message["content"] = ""
                message.setdefault("refusal", None)  # required by OpenAI's schema, null if none
            else:
                choice.setdefault("text", "")
        return {
            "id": self.id or fallback_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created or created,
            "model": model,
            "choices": [self.choices[i] for i in sorted(self.choices)],
            "usage": usage,
            **({"moderation": self.moderation} if self.moderation is not None else {}),
        }
