"""A request run to completion without an HTTP request: a batch line in a Celery worker
(``run_whole``: the same limits, admission, routing and metering as online, its answer
whole), and the semantic cache's embedding of a request's text, run as the tenant's own
embeddings request (``embedder``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
from django.conf import settings
from django.db import DatabaseError
from redis.exceptions import RedisError

from contract import UsageRecord
from inference.gateway import cache
from inference.gateway.admission import admission
from inference.gateway.auth import KeyInfo
from inference.gateway.call import State
from inference.gateway.errors import ApiError, lent_reclaimed, overloaded
from inference.gateway.lifecycle import Lifecycle
from inference.gateway.prepare import Embed
from inference.gateway.seams import InputCheck, OutputFilter

_NOT_KEPT = cache.Directives(read=False, store=False)


def embedder(key: KeyInfo) -> Embed:
    """How the semantic cache embeds a text for ``key``'s tenant (``Lifecycle.begin``)."""
    return lambda model, text: _embed(key, model, text)


async def _embed(key: KeyInfo, model: str, text: str) -> list[float] | None:
    """``text``'s vector from ``model``, as the tenant's own embeddings request (admitted to
    the embedding pool, metered and billed like any): the semantic cache's lookup. In a task
    of its own, so its request id stays its own; None when it is refused or fails."""
    body = orjson.dumps({"model": model, "input": text, "encoding_format": "float"})
    # Within a budget (the chat waits on it, holding its limits), and not kept in the exact
    # cache itself (its vector is kept with the answer).
    lookup = asyncio.ensure_future(
        run_whole(key=key, raw_body=body, endpoint="embeddings", asked=_NOT_KEPT)
    )
    try:
        status, answer = await asyncio.wait_for(
            lookup, settings.INFERPLANE_RESPONSE_CACHE_EMBED_MS / 1000
        )
    except TimeoutError:
        return None
    if status != 200:
        return None
    data = answer.get("data") or [{}]
    vector = data[0].get("embedding")
    return vector if isinstance(vector, list) else None


async def run_whole(
    *,
    key: KeyInfo,
    raw_body: bytes,
    endpoint: str,
    pool: str | None = None,
    output_filter: OutputFilter | None = None,
    input_check: InputCheck | None = None,
    mode: str = "online",
    ledger: Callable[[UsageRecord], None] | None = None,
    admitted: Callable[[str], None] | None = None,
    asked: cache.Directives | None = None,
    lend: str | None = None,
    lend_open: Callable[[], bool] | None = None,
) -> tuple[int, dict[str, Any]]:
    """One request run to completion without an HTTP request (a batch line in a Celery
    worker: ``async_to_sync(run_whole)(...)``, or many at once in one ``asyncio.run``):
    the same limits, admission, routing and metering as online, on ``pool`` if given.
    Returns (200, the non-streamed OpenAI body) — whatever the body's ``stream`` says — or
    (the status, the OpenAI error body) as the HTTP endpoint would answer them. Without an
    output filter or input check the engine is asked for its answer whole, not streamed
    (``Call.whole``): the same answer and counts, at less work per token. ``admitted`` is
    told the pool it was admitted to; ``lend``: an online pool that may lend it idle room
    (``prepare``), which it gives back when online requests need it: the engine's work is
    aborted and the answer is the 503 ``lent_capacity_reclaimed`` (nothing billed: the
    caller drops its record and runs it again); ``lend_open``: whether it may still ask
    for lent room while it waits for ``pool``. It has no embedder: a semantic cache's lookup
    is exact only here (batch lines pass the cache by anyway)."""
    try:
        life = await Lifecycle.begin(
            key=key,
            raw_body=raw_body,
            endpoint=endpoint,
            pool=pool,
            output_filter=output_filter,
            input_check=input_check,
            mode=mode,
            ledger=ledger,
            # A check or filter that stops the answer bills what the engine made: only a
            # stream says how much that was.
            whole=output_filter is None and input_check is None,
            asked=asked,
            lend=lend,
            lend_open=lend_open,
        )
        if admitted is not None:  # past limits and admission: a replica is ours now
            admitted(life.call.route.pool)
        reclaimed = admission().reclaimed.get(life.call.rid) if life.call.route.lent else None
        if reclaimed is None:
            return await _answer(life)
        return await _until_reclaimed(life, reclaimed)
    except ApiError as error:
        return error.status, error.body()
    except (RedisError, DatabaseError):
        # As online: without Redis nothing is served unmetered.
        busy = overloaded(1, "The service is briefly unavailable. Retry in a moment.")
        return busy.status, busy.body()


async def _answer(life: Lifecycle) -> tuple[int, dict[str, Any]]:
    async with life:
        return await _whole(life)


async def _whole(life: Lifecycle) -> tuple[int, dict[str, Any]]:
    await life.start()
    return 200, await life.whole()


async def _until_reclaimed(life: Lifecycle, reclaimed: asyncio.Event) -> tuple[int, dict[str, Any]]:
    """A lent call's answer, unless its room is taken back first: then its engine work is
    aborted (closing the connection aborts it in vLLM) and it ends cut off, counting toward
    nothing (``Call.reclaimed``)."""
    async with life:  # entered here, so that it is settled however the wait below ends
        answering = asyncio.ensure_future(_whole(life))
        watching = asyncio.ensure_future(reclaimed.wait())
        try:
            await asyncio.wait((answering, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not answering.done():
                answering.cancel()
                await asyncio.gather(answering, return_exceptions=True)
        # Taken back, or failed because it was (its replica failed over as the room was
        # taken: the request was gone from admission): a lost room, not the line's failure.
        lost = (
            answering.cancelled()
            or life.call.reclaimed
            or (reclaimed.is_set() and answering.exception() is not None)
        )
        if not lost:
            return answering.result()  # it finished first: kept
        call = life.call
        call.reclaimed = True
        if call.state.live:
            call.fail("its lent room was taken back", outcome=State.CUT_OFF)
        raise lent_reclaimed()
