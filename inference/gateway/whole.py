"""Whole answers (``Call.whole``: a batch line, nobody watches it arrive): one non-streamed
request to the engine, its wait watched against the replica's health, the answer bounded by
its mode's size (past it, read through for its usage and billed whole)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import orjson
from django.conf import settings

from inference.gateway import responses
from inference.gateway.call import Call
from inference.gateway.catalog import catalog_view

WATCH_SECONDS = 1.0  # how often a wait for a whole answer looks at its replica's health


TAIL_BYTES = 4096  # the end of a whole answer, where its usage is


def _usage_in_tail(tail: bytes) -> dict[str, Any]:
    """The ``usage`` object of a JSON answer, from its last bytes (vLLM writes it near the
    end), or {} when none is there."""
    at = tail.rfind(b'"usage":')
    if at < 0:
        return {}
    try:
        usage, _ = json.JSONDecoder().raw_decode(tail[at + len(b'"usage":') :].decode().lstrip())
    except (ValueError, UnicodeDecodeError):
        return {}
    return usage if isinstance(usage, dict) else {}


class Unanswered(Exception):
    """A replica did not answer a request in time (or was found dead meanwhile)."""


async def post_whole(
    call: Call, session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[int, bytes]:
    """Send a request for a whole answer (``Call.whole``): its (status, body).

    The engine says nothing until its answer is complete, so the first-byte and stall
    bounds do not apply: the wait is watched instead. A replica that the health probe
    marks down meanwhile (dead, stopped, stuck: the catalog says so within seconds),
    or that leaves the pool, fails the request over at once (``Unanswered``); an answer
    slower than ``INFERPLANE_ENGINE_WHOLE_TIMEOUT_SECONDS`` is a 504 for this request
    alone (the replica is not blamed: slow is not dead)."""
    limit = settings.INFERPLANE_ENGINE_WHOLE_TIMEOUT_SECONDS
    posting = asyncio.ensure_future(_read_whole(call, session, url, headers))
    view = catalog_view()
    deadline = time.monotonic() + limit
    try:
        while True:
            done, _ = await asyncio.wait((posting,), timeout=WATCH_SECONDS)
            if done:
                return posting.result()
            if time.monotonic() > deadline:
                # Slow is not dead: the replica stays in rotation (the probe decides).
                call.fail(f"{call.replica_name}: no whole answer within {limit} s")
                raise responses.too_slow(limit)
            pool = view.data.pools.get(call.route.pool) if view.data is not None else None
            replica = pool.replicas.get(call.route.replica) if pool is not None else None
            if pool is not None and (replica is None or replica.state == "down"):
                raise Unanswered("the replica went down while answering")
    finally:
        if not posting.done():  # closing the connection aborts the engine's work
            posting.cancel()
            await asyncio.gather(posting, return_exceptions=True)


async def _read_whole(
    call: Call, session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[int, bytes]:
    """(status, body) of one non-streamed request: an answer up to its mode's bound
    (``responses.answer_limit``; past it, the 400 that online non-streamed answers
    give), an error up to 64 KiB."""
    try:
        response = await session.post(url, data=call.body, headers=headers)
    except aiohttp.ServerDisconnectedError:  # a pooled keep-alive connection just closed
        response = await session.post(url, data=call.body, headers=headers)
    limit = responses.answer_limit(call.mode) if response.status == 200 else 65536
    parts: list[bytes] = []
    size = 0
    try:
        async for part in response.content.iter_any():
            size += len(part)
            if size > limit:
                if response.status == 200:
                    await _too_large(call, response, parts, part, limit)
                break
            parts.append(part)
    finally:
        if size > limit:
            response.close()
        else:
            response.release()
    return response.status, b"".join(parts)


async def _too_large(
    call: Call, response: aiohttp.ClientResponse, parts: list[bytes], part: bytes, limit: int
) -> None:
    """An answer past its bound: the engine made it whole, so it is billed whole. Its
    usage is the last object in it: the rest is read through, keeping only a tail, for
    that (the memory held stays the bound). Raises the 400 the client gets."""
    tail = (b"".join(parts[-4:]) + part)[-TAIL_BYTES:]
    parts.clear()
    async for more in response.content.iter_any():
        tail = (tail + more)[-TAIL_BYTES:]
    usage = _usage_in_tail(tail)
    counts = call.counts
    counts.prompt = usage.get("prompt_tokens") or 0
    counts.completion = usage.get("completion_tokens") or 0
    call.fail("non-streamed response too large")
    raise responses.too_large(limit)


def take_whole(call: Call, body: bytes) -> dict[str, Any]:
    """A whole answer, parsed: its counts are the engine's usage, and the call has ended."""
    try:
        answer: dict[str, Any] = orjson.loads(body)
        usage = answer.get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        raise Unanswered("its answer is not JSON") from None
    counts = call.counts
    counts.prompt = usage.get("prompt_tokens") or 0
    counts.completion = usage.get("completion_tokens") or 0
    counts.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    call.streaming()
    call.end()
    return answer
