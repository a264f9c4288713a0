"""Where other legs plug into a request's life without knowing its transport: an output
filter the stream passes through and an input check beside the upstream request (for
moderation), both given to ``Lifecycle.begin``. Absent, they cost nothing: the transport
iterates the relay itself and the request goes straight to the engine.

An **output filter** sees every batch of OpenAI-shaped chunks before the transport writes
it, in order, and answers with a ``Screened``: the chunks to write now (the batch, fewer —
it holds text back — or more, releasing what it held), and optionally a ``cut``. On a cut
the engine's stream is stopped (vLLM aborts), the client gets what was released, then a
final chunk per unfinished choice with ``finish_reason: "content_filter"`` (and the usage
chunk if asked for), then the transport's normal end (``[DONE]`` for SSE); the ledger gets
the tokens the engine made, with status ``content_filter``. When the engine has finished,
``end()`` releases (or cuts) whatever is still held.

An **input check** runs concurrently with ``relay.start()`` (so it overlaps the engine's
prefill) and is awaited before anything is released: ``None`` lets the request through, a
message refuses it. A refused request answers 400 ``content_policy_violation``
(``invalid_request_error``); its engine request is closed and what was made is metered.

A **guard source** gives both for a tenant's requests without the transport asking: the
moderation app registers one when it is ready (``guard_source_set``), and ``Lifecycle.begin``
consults it for every request given no seams of its own (SSE, WebSocket, non-streamed, batch
lines alike). It answers None for a tenant that does not moderate: then the request runs as
if there were no source at all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from contract import UsageRecord
from inference.gateway.auth import KeyInfo
from inference.gateway.errors import ApiError
from inference.gateway.schema import ParsedRequest

Chunk = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Screened:
    """An output filter's answer: the chunks to write now, in order; ``cut``, when set, is
    why the answer stops after them (what the filter still holds is dropped)."""

    release: list[Chunk]
    cut: str | None = None


class OutputFilter(Protocol):
    async def screen(self, batch: list[Chunk]) -> Screened:
        """One batch, as the relay yields it (cleaned; the usage chunk included)."""
        ...

    async def end(self) -> Screened:
        """The engine finished: what is still held, released or cut."""
        ...


# (the request as validated, its key) -> None to pass, or the refusal shown to the client.
InputCheck = Callable[[ParsedRequest, KeyInfo], Awaitable[str | None]]


class RequestGuard(OutputFilter, Protocol):
    """One request's guard: what it checks of the input before it waits for admission (cheap
    checks: a refusal then costs the engine nothing), its input check beside the prefill
    (None: nothing more to check; read once ``input_rules`` passed), its output filter,
    what it makes of the engine's request body before it is sent (masking, say), and what
    it does once the request has ended (``spent``: what its checks used, counted toward the
    request's limits; ``settle``: its own usage record, to the ledger)."""

    async def input_rules(self, parsed: ParsedRequest, key: KeyInfo) -> str | None: ...

    @property
    def input_check(self) -> InputCheck | None: ...

    def rewrite(self, upstream: bytes) -> bytes: ...

    @property
    def rewrites(self) -> bool:
        """Whether ``rewrite`` changes the body (then no cached answer stands for it)."""
        ...

    async def spent(self, *, mode: str) -> tuple[int, int]:
        """The request has ended: its checks are stopped; what they used, as (tokens, their
        cost in micro-dollars), counted toward the request's limits and budgets."""
        ...

    async def settle(
        self, *, mode: str, ledger: Callable[[UsageRecord], None] | None = None
    ) -> None:
        """The request has ended (metered, released): what its checks cost is recorded,
        through ``ledger`` when the request's own record went there."""


# (the request's id, the request as validated, the engine's completion tokens so far per
# choice — updated as chunks arrive, before the filter sees them) -> its guard
GuardBuilder = Callable[[str, ParsedRequest, Mapping[int, int]], RequestGuard]
# the key -> the builder for its tenant's requests, or None when the tenant is not moderated
GuardSource = Callable[[KeyInfo], Awaitable[GuardBuilder | None]]

_source: list[GuardSource] = []


def guard_source_set(source: GuardSource | None) -> None:
    _source[:] = [source] if source is not None else []


async def guard_for(key: KeyInfo) -> GuardBuilder | None:
    return await _source[0](key) if _source else None


class PassThrough:
    """The filter that changes nothing (what no filter does, at the cost of a filter)."""

    async def screen(self, batch: list[Chunk]) -> Screened:
        return Screened(batch)

    async def end(self) -> Screened:
        return Screened([])


def input_refused(message: str) -> ApiError:
    """What a client whose input an input check refused gets (nothing was sent yet)."""
    return ApiError(400, message, type="invalid_request_error", code="content_policy_violation")


def cut_chunks(
    *,
    chat: bool,
    model: str,
    rid: str,
    created: int,
    unfinished: list[int],
    usage: dict[str, Any] | None,
    null_usage: bool,
) -> list[Chunk]:
    """The end of a cut answer in OpenAI's shape: each unfinished choice finishes with
    ``content_filter``; then the usage chunk, when the request asked for one."""
    out: list[Chunk] = []
    if chat:
        choices: list[Chunk] = [
            {"index": i, "delta": {}, "logprobs": None, "finish_reason": "content_filter"}
            for i in unfinished
        ]
        head: Chunk = {"id": rid, "object": "chat.completion.chunk", "created": created}
    else:
        choices = [
            {"index": i, "text": "", "logprobs": None, "finish_reason": "content_filter"}
            for i in unfinished
        ]
        head = {"id": rid, "object": "text_completion", "created": created}
    if choices:
        out.append({**head, "model": model, "choices": choices})
        if null_usage:
            out[-1]["usage"] = None
    if usage is not None:
        out.append({**head, "model": model, "choices": [], "usage": usage})
    return out
