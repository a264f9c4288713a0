"""The texts moderation reads: every text the engine reads of a request (``engine_read``,
``input_texts``; ``mask_body`` rewrites them) and every text a streamed choice shows the client
(``visible_texts``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from inference.gateway.schema import ParsedRequest
from moderation.rules import mask


def _walk(value: Any, rewrite: Any) -> None:
    """Every string inside a JSON list or object (a tool's definition: its name, description
    and parameters' schema; keys too, a property's name is read as well) through ``rewrite``,
    in place where it changes one. A loop, not recursion: any depth the JSON parser took."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, item in enumerate(node):
                if isinstance(item, str):
                    new = rewrite(item)
                    if new is not item:
                        node[i] = new
                elif isinstance(item, list | dict):
                    stack.append(item)
        elif isinstance(node, dict):
            for key in list(node):
                item = node[key]
                new_key = rewrite(key) if isinstance(key, str) else key
                if isinstance(item, str):
                    new = rewrite(item)
                    if new is not item or new_key is not key:
                        del node[key]
                        node[new_key] = new
                    continue
                if new_key is not key:
                    node[new_key] = node.pop(key)
                if isinstance(item, list | dict):
                    stack.append(item)


def _rewrite(container: Any, key: Any, rewrite: Any) -> None:
    value = container[key]
    if isinstance(value, str):
        new = rewrite(value)
        if new is not value:
            container[key] = new
    else:
        _walk(value, rewrite)


def engine_read(body: dict[str, Any], rewrite: Any) -> None:
    """Every text of a request the engine may read, through ``rewrite`` (a string in, the
    same string or another out; stored only when another): every field of every message but
    its role (content's text and refusal parts, ``name``, tool calls, ``tool_call_id``,
    reasoning, whatever a chat template may render), the tools' definitions, the template's
    ``chat_template_kwargs``; a completion's prompts and ``suffix``. The input check reads
    them all, PII masking masks them all. Images and audio are not text: not read."""
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        for name in list(message):
            content = message[name]
            if name == "role":
                continue
            if name == "content" and isinstance(content, list):
                for part in content:
                    for field in ("text", "refusal"):
                        if isinstance(part, dict) and isinstance(part.get(field), str):
                            _rewrite(part, field, rewrite)
            else:
                _rewrite(message, name, rewrite)
    for name in ("tools", "chat_template_kwargs", "prompt", "suffix"):
        if name in body:
            _rewrite(body, name, rewrite)


def input_texts(parsed: ParsedRequest) -> list[str] | None:
    """The request's text as the checks read it (one text: everything the engine reads,
    one part a line); None for a completion's token ids, which carry no text to read."""
    body = parsed.body
    prompt = body.get("prompt")
    if parsed.endpoint != "chat.completions" and not (
        isinstance(prompt, str)
        or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt))
    ):
        return None
    texts: list[str] = []

    def collect(text: str) -> str:
        texts.append(text)
        return text

    engine_read(body, collect)  # returns each text as it came: nothing is changed
    return ["\n".join(texts)]


def mask_body(upstream: bytes, assess_pii: Any) -> bytes:
    body = orjson.loads(upstream)
    changed = False

    def masked(text: str) -> str:
        nonlocal changed
        spans = assess_pii(text)
        if spans:
            changed = True
            return mask(text, spans)
        return text

    engine_read(body, masked)
    return orjson.dumps(body) if changed else upstream


def _alternatives(entries: Any, chosen: Any) -> list[str]:
    """The top alternatives a logprobs entry shows beside the token it chose."""
    out: list[str] = []
    if isinstance(entries, list):  # chat: [{"token": ..., "logprob": ...}, ...]
        out = [e.get("token", "") for e in entries if isinstance(e, dict)]
    elif isinstance(entries, dict):  # completions: {token: logprob, ...}
        out = list(entries)
    return [t for t in out if isinstance(t, str) and t != chosen and t.strip()]


def visible_texts(choice: Mapping[str, Any], *, chat: bool) -> dict[str, str]:
    """Every text a streamed choice's delta shows the client, by stream: the answer, a
    refusal, reasoning, each tool call's name and arguments, and the tokens ``logprobs``
    offers as alternatives (one a line: each is read as a word of its own; the chosen tokens
    are the answer's text already). A stream's deltas join into its text; streams are read
    apart, so a word split across two deltas of one stream is still whole."""
    out: dict[str, str] = {}
    if chat:
        delta = choice.get("delta") or {}
        for name, stream in (
            ("content", "text"),
            ("refusal", "refusal"),
            ("reasoning_content", "reasoning"),
            ("reasoning", "reasoning"),
        ):
            value = delta.get(name)
            if isinstance(value, str) and value:
                out[stream] = out.get(stream, "") + value
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            function = call.get("function") or {}
            for part in ("name", "arguments"):
                value = function.get(part)
                if isinstance(value, str) and value:
                    out[f"tool {call.get('index', 0)} {part}"] = value
        logprobs = choice.get("logprobs") or {}
        entries = [*(logprobs.get("content") or ()), *(logprobs.get("refusal") or ())]
        alternatives = [
            word
            for entry in entries
            if isinstance(entry, dict)
            for word in _alternatives(entry.get("top_logprobs"), entry.get("token"))
        ]
    else:
        text = choice.get("text")
        if isinstance(text, str) and text:
            out["text"] = text
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        alternatives = [
            word
            for i, entries in enumerate(logprobs.get("top_logprobs") or ())
            for word in _alternatives(entries, tokens[i] if i < len(tokens) else None)
        ]
    if alternatives:
        out["alternatives"] = "".join(word + "\n" for word in alternatives)
    return out
