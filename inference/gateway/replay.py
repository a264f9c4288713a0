"""A cache hit replayed: the stored answer as the chunks a stream of it would have had, in
the caller's shape, with nothing sent to an engine (docs/cache.md)."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the call it answers
    from inference.gateway.call import Call

# A replayed stream's text, a word to an event: about a token each, as the engine streamed
# it (the moderation's windows count a stream's events as tokens at least).
WORDS_PER_CHUNK = 1

_WORDS = re.compile(r"\s*\S+\s*")


def _pieces(text: str) -> list[str]:
    """A text in the pieces a stream would have brought it in."""
    words = _WORDS.findall(text) or [text]
    return ["".join(words[i : i + WORDS_PER_CHUNK]) for i in range(0, len(words), WORDS_PER_CHUNK)]


def replay_chunks(
    entry: dict[str, Any], *, chat: bool, rid: str, created: int, model: str, null_usage: bool
) -> list[dict[str, Any]]:
    """A stored answer as the chunks of a stream (the final usage chunk is the caller's)."""
    head: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
    }
    tail = {"usage": None} if null_usage else {}
    chunks: list[dict[str, Any]] = []

    def chunk(index: int, finish: str | None = None, **part: Any) -> None:
        choice: dict[str, Any] = {"index": index, **part, "logprobs": None, "finish_reason": finish}
        chunks.append({**head, "choices": [choice], **tail})

    for stored in entry["choices"]:
        index = stored.get("index", 0)
        ending = {"stop_reason": stored["stop_reason"]} if "stop_reason" in stored else {}
        if not chat:
            for piece in _pieces(stored.get("text") or ""):
                chunk(index, text=piece)
            chunk(index, stored.get("finish_reason"), text="", **ending)
            continue
        message = stored.get("message") or {}
        chunk(index, delta={"role": "assistant", "content": ""})
        for name in ("reasoning_content", "reasoning", "content", "refusal"):
            for piece in _pieces(message.get(name) or "") if message.get(name) else ():
                chunk(index, delta={name: piece})
        for position, call in enumerate(message.get("tool_calls") or ()):
            chunk(index, delta={"tool_calls": [{"index": position, **call}]})
        chunk(index, stored.get("finish_reason"), delta={}, **ending)
    return chunks


class Replay:
    """The relay's stand-in on a hit: the stored answer, as the chunks a stream of it would
    have had, with nothing sent to an engine (no replica was taken)."""

    answer: dict[str, Any] | None = None  # never the engine's whole answer

    def __init__(self, call: Call, entry: dict[str, Any]) -> None:
        self.call = call
        self.entry = entry

    async def start(self) -> None:
        call = self.call
        call.streaming()
        call.counts.ttft_ms = int((time.perf_counter() - call.t0) * 1000)

    def usage(self) -> dict[str, Any]:
        """What the answer's usage said when the engine made it (billed: nothing)."""
        return dict(self.entry.get("usage") or self.call.usage())

    async def __aiter__(self) -> AsyncGenerator[list[dict[str, Any]]]:
        call = self.call
        parsed = call.parsed
        chat = parsed.endpoint == "chat.completions"
        chunks = replay_chunks(
            self.entry,
            chat=chat,
            rid=call.rid,
            created=int(call.started_at.timestamp()),
            model=parsed.model,
            null_usage=parsed.include_usage and chat,
        )
        if parsed.include_usage:
            chunks.append({**chunks[0], "choices": [], "usage": self.usage()})
        yield chunks
        call.end()  # delivered: a client gone before this is a cut-off

    async def drain(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def stop(self) -> None:
        return None
