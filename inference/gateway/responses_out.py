"""The Responses API's answers, from a chat completion's: the response object (its
skeleton, then ended with its output, status and usage), the output items of a whole answer,
and the typed stream events of a streamed one (``EventStream``). The request side is
``responses_in``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from inference.gateway.items import new_id


def skeleton(body: dict[str, Any], *, response_id: str, created_at: int) -> dict[str, Any]:
    """The response object before its output: what the request asked for, as OpenAI echoes
    it back, ``in_progress``."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    reasoning = body.get("reasoning") or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body["model"],
        "output": [],
        "parallel_tool_calls": _given(body, "parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": body.get("store") is not False,  # null is the default: stored
        "temperature": _given(body, "temperature", 1.0),
        "text": {"format": fmt},
        "tool_choice": _given(body, "tool_choice", "auto"),
        "tools": [_tool_echo(tool) for tool in body.get("tools") or ()],
        "top_p": _given(body, "top_p", 1.0),
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "service_tier": "default",
        **({"user": body["user"]} if body.get("user") is not None else {}),
    }


def _given(body: dict[str, Any], name: str, default: Any) -> Any:
    """A field as the client set it, or OpenAI's default when it did not (or sent null)."""
    value = body.get(name)
    return default if value is None else value


def _tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as the response names it back (OpenAI's fields, each present)."""
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": bool(tool.get("strict")),
    }


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's usage in the Responses API's words (the same engine counts)."""
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": prompt,
        # Cache writes are not billed apart (nothing to report): the prefix cache is the
        # engine's own.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


# How a chat completion's finish_reason ends a response: (status, incomplete_details).
ENDINGS: dict[str | None, tuple[str, dict[str, str] | None]] = {
    "length": ("incomplete", {"reason": "max_output_tokens"}),
    "content_filter": ("incomplete", {"reason": "content_filter"}),
}


def finished(
    response: dict[str, Any],
    *,
    output: list[dict[str, Any]],
    finish_reason: str | None,
    chat_usage: dict[str, Any],
    error: str | None = None,
) -> dict[str, Any]:
    """The response object, ended: its output, status and usage."""
    if error is not None:
        status, incomplete = "failed", None
        response["error"] = {"code": "server_error", "message": error}
    else:
        status, incomplete = ENDINGS.get(finish_reason, ("completed", None))
    response["status"] = status
    response["incomplete_details"] = incomplete
    response["completed_at"] = int(time.time()) if status == "completed" else None
    for item in output:
        if item.get("status") == "in_progress":
            item["status"] = "completed" if status == "completed" else "incomplete"
    response["output"] = output
    response["usage"] = usage(chat_usage)
    return response


def output_of_answer(answer: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """(the output items, the finish_reason) of a whole chat completion."""
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        output.append(_reasoning_item(reasoning, "completed"))
    content = message.get("content")
    calls = message.get("tool_calls") or []
    if content or not calls:
        output.append(_message_item(content or "", "completed"))
    output.extend(
        _call_item(
            c.get("id") or new_id("call"),
            (c.get("function") or {}).get("name") or "",
            (c.get("function") or {}).get("arguments") or "",
            "completed",
        )
        for c in calls
    )
    return output, choice.get("finish_reason")


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {
        "id": new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def assistant_turn(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat message a response's output adds to its conversation (reasoning left out,
    as chat templates leave it)."""
    texts = [
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part.get("type") == "output_text"
    ]
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return [message]


@dataclass
class _Open:
    """An output item being streamed: its place, and its text so far."""

    index: int
    item: dict[str, Any]
    parts: list[str] = field(default_factory=list)


class EventStream:
    """A chat completion's chunks as the Responses API's typed stream events, numbered
    (``sequence_number``), each output item opened and closed as OpenAI's stream does: one
    at a time, in order — reasoning, the message's text, each function call."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.current: _Open | None = None  # the item being streamed
        self.calls: dict[int, _Open] = {}  # function calls by the engine's index
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return event

    def begin(self) -> list[dict[str, Any]]:
        snapshot = dict(self.response)
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                events.extend(self._delta("reasoning", reasoning))
            if delta.get("content"):
                events.extend(self._delta("message", delta["content"]))
            for call in delta.get("tool_calls") or ():
                events.extend(self._call(call))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _switch(self, item: dict[str, Any]) -> tuple[list[dict[str, Any]], _Open]:
        """Close the item being streamed and open ``item``."""
        events = self._close("completed")
        self.current = opened = _Open(len(self.output), item)
        self.output.append(item)
        shown = {**item, "content": []} if "content" in item else dict(item)
        events.append(
            self.event("response.output_item.added", output_index=opened.index, item=shown)
        )
        if item["type"] == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    **self._where(opened),
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        return events, opened

    @staticmethod
    def _where(opened: _Open) -> dict[str, Any]:
        return {"item_id": opened.item["id"], "output_index": opened.index, "content_index": 0}

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        opened = self.current
        if opened is None or opened.item["type"] != kind:
            made = _reasoning_item if kind == "reasoning" else _message_item
            events, opened = self._switch(made("", "in_progress"))
        opened.parts.append(text)
        if kind == "reasoning":
            events.append(
                self.event("response.reasoning_text.delta", **self._where(opened), delta=text)
            )
        else:
            events.append(
                self.event(
                    "response.output_text.delta",
                    **self._where(opened),
                    delta=text,
                    logprobs=[],
                )
            )
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        position = int(call.get("index") or 0)
        function = call.get("function") or {}
        opened = self.calls.get(position)
        if opened is None:
            item = _call_item(call.get("id") or new_id("call"), "", "", "in_progress")
            item["name"] = function.get("name") or ""
            events, opened = self._switch(item)
            self.calls[position] = opened
        elif function.get("name"):
            opened.item["name"] += function["name"]
        arguments = function.get("arguments")
        if arguments and opened is self.current:  # a closed call takes no more (vLLM sends none)
            opened.parts.append(arguments)
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=opened.item["id"],
                    output_index=opened.index,
                    delta=arguments,
                )
            )
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The events that end the item being streamed, now ``status``."""
        opened, self.current = self.current, None
        if opened is None:
            return []
        item, text = opened.item, "".join(opened.parts)
        item["status"] = status
        where = self._where(opened)
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events = [self.event("response.reasoning_text.done", **where, text=text)]
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            events = [
                self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=part),
            ]
        else:
            item["arguments"] = text
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    name=item["name"],
                    output_index=opened.index,
                    arguments=text,
                )
            ]
        events.append(self.event("response.output_item.done", output_index=opened.index, item=item))
        return events

    def close(
        self, *, chat_usage: dict[str, Any], error: str | None = None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The events that close the last item, and the whole response (its output, status
        and usage); ``terminal`` then ends the stream."""
        status, _ = ENDINGS.get(self.finish_reason, ("completed", None))
        if error is not None:
            status = "failed"
        events: list[dict[str, Any]] = []
        if not self.output and error is None:
            # A response that said nothing still has its (empty) message, as OpenAI's do.
            events, _ = self._switch(_message_item("", "in_progress"))
        events.extend(self._close("completed" if status == "completed" else "incomplete"))
        response = finished(
            self.response,
            output=self.output,
            finish_reason=self.finish_reason,
            chat_usage=chat_usage,
            error=error,
        )
        return events, response

    def terminal(
        self, response: dict[str, Any], *, problem: tuple[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """The stream's last events: ``problem`` (code, message) as an ``error`` event, then
        ``response.completed``, ``.incomplete`` or ``.failed`` with the whole response."""
        events = []
        if problem is not None:
            code, message = problem
            events.append(self.event("error", code=code, message=message, param=None))
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed"
        )
        events.append(self.event(kind, response=response))
        return events
