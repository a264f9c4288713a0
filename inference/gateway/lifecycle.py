"""A request's life in the gateway, whatever carries it (SSE, JSON, WebSocket — and, with the
batch leg, a Celery worker): one object that owns it from the checked key to the ledger.

    life = await Lifecycle.begin(key=key, raw_body=body, endpoint="chat.completions")
    async with life:
        await life.start()                # route, send; another replica if one fails first
        async for batch in life:          # the engine's chunks, in OpenAI's shape
            ...                           # the transport writes them

``begin`` validates, resolves the model, takes the limits, runs the guard's rules (an input
they refuse waits for no replica) and waits for admission (``prepare.prepare``; an
``ApiError`` there leaves nothing held). Leaving the ``async with``,
however it is left — the answer complete, an error, the client gone (``ClientGone``) or the
task cancelled — closes the engine's stream (draining it first when the client left or a
filter stopped it, so the tokens made are counted), meters the call and frees its slot and
limits, shielded from cancellation, exactly once. The call's state moves only through its
own methods (``call.State``); its outcome and error are set only by ``Call.fail`` and
``Call.note``, and it is settled by ``settle.finish``.

``begin`` also takes the seams of ``inference.gateway.seams``: an output filter the chunks pass
through, an input check run beside the upstream request, and a pool to run on instead of
the model's online one. ``headless.run_whole`` runs one request to its non-streamed answer,
for code that has no HTTP request (a batch line in a Celery worker).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from types import TracebackType
from typing import Any

from django.conf import settings

from contract import UsageRecord
from inference.gateway import cache, responses
from inference.gateway.auth import KeyInfo
from inference.gateway.call import Call, MidStreamError, State
from inference.gateway.errors import ApiError
from inference.gateway.prepare import Embed, Screen, prepare
from inference.gateway.relay import Relay
from inference.gateway.replay import Replay
from inference.gateway.schema import PREFILL_ONLY, ParsedRequest
from inference.gateway.seams import (
    InputCheck,
    OutputFilter,
    RequestGuard,
    Screened,
    cut_chunks,
    guard_for,
    input_refused,
)
from inference.gateway.settle import finish


class ClientGone(Exception):
    """The client left while its request was answering (a closed WebSocket)."""


class Lifecycle:
    def __init__(
        self,
        call: Call,
        *,
        output_filter: OutputFilter | None = None,
        input_check: InputCheck | None = None,
        tokens: dict[int, int] | None = None,
    ) -> None:
        self.call = call
        # An answer from the tenant's response cache takes the engine's place.
        ticket = call.cache
        self.relay: Relay | Replay = (
            Replay(call, ticket.entry)
            if ticket is not None and ticket.entry is not None
            else Relay(call, tokens)
        )
        self.output_filter = output_filter
        self.input_check = input_check
        self.guard: RequestGuard | None = None  # the tenant's moderation, when it has one
        self.refused: str | None = None  # why its guard's rules refused it before admission

    @classmethod
    async def begin(
        cls,
        *,
        key: KeyInfo,
        raw_body: bytes,
        endpoint: str,
        pool: str | None = None,
        output_filter: OutputFilter | None = None,
        input_check: InputCheck | None = None,
        mode: str = "online",
        ledger: Callable[[UsageRecord], None] | None = None,
        whole: bool = False,
        rid: str = "",
        surface: str = "",
        asked: cache.Directives | None = None,
        lend: str | None = None,
        lend_open: Callable[[], bool] | None = None,
        embed: Embed | None = None,
    ) -> Lifecycle:
        """``pool``: the pool to run on (by name) instead of the model's online pool;
        ``mode`` and ``ledger``: how the call is billed and where its record goes;
        ``whole``: the engine answers non-streamed (``Call``; then ``whole()`` is the only
        way to read the answer, and no output filter applies); ``rid``: the request id the
        transport gave the request already (``controlplane.logs``), else a new one;
        ``surface``: the public endpoint when it is not ``endpoint`` (``/v1/responses`` runs
        as a chat completion), for the ledger and the metrics; ``asked``: what the request's
        headers ask of the tenant's response cache; ``lend`` and ``lend_open``: an online
        pool that may lend the call idle room, and whether it may still be asked
        (``prepare``); ``embed``: how the semantic cache embeds a request's text
        (``headless.embedder``; without it the lookup is exact only)."""
        if whole and (output_filter is not None or input_check is not None):
            raise ValueError("a filter or check that can stop the answer needs its stream")
        # The tenant's moderation, unless the caller brought seams of its own.
        build = None
        # Embeddings generate nothing to moderate, and their answer comes whole.
        if output_filter is None and input_check is None and endpoint not in PREFILL_ONLY:
            build = await guard_for(key)
        guards: list[RequestGuard] = []  # the request's guard, once its id is known
        refused: list[str] = []
        tokens: dict[int, int] = {}  # the engine's completion tokens by choice (the relay's)
        screen: Screen | None = None
        if build is not None:
            made = build

            async def screen_rules(
                rid: str, parsed: ParsedRequest, ticket: cache.Ticket | None
            ) -> str | None:
                """The guard's cheap checks, before admission: an input they refuse waits
                for no replica and is never sent (the engine does nothing: nothing billed).
                A prompt the guard rewrites (masks) is not the prompt a cached answer had."""
                guards.append(made(rid, parsed, tokens))
                if ticket is not None and guards[0].rewrites:
                    cache.pass_by(ticket, "rewritten")
                refusal = await guards[0].input_rules(parsed, key)
                if refusal is not None:
                    refused.append(refusal)
                return refusal

            screen = screen_rules
        call = await prepare(
            key=key,
            raw_body=raw_body,
            endpoint=endpoint,
            pool=pool,
            mode=mode,
            ledger=ledger,
            # A guard that can stop the answer bills what the engine made: only a stream
            # says how much that was.
            whole=whole and build is None,
            rid=rid,
            screen=screen,
            surface=surface,
            asked=asked,
            embed=embed,
            lend=lend,
            lend_open=lend_open,
        )
        life = cls(call, output_filter=output_filter, input_check=input_check, tokens=tokens)
        if not guards:
            return life
        guard = life.guard = guards[0]
        if refused:  # the rules refused it (``screen``): it holds no slot; ``start`` says so
            life.refused = refused[0]
            return life
        try:
            call.body = guard.rewrite(call.body)
            life.output_filter, life.input_check = guard, guard.input_check
        except BaseException as exc:
            # The call holds its limits (and admission) already: released (and metered) as
            # a caller's ``async with`` would have.
            await life.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return life

    async def start(self) -> None:
        """Send the request (``Relay.start``) and, with an input check, run it meanwhile:
        this returns once both are through, so nothing reaches the client unchecked (a
        guard's cheap checks ran before admission, in ``begin``). A refusal raises the 400
        the client gets (``seams.input_refused``), also for an input the rules refused in
        ``begin`` (it was never admitted: nothing is sent)."""
        call = self.call
        if self.refused is not None:
            raise input_refused(self.refused)
        check = self.input_check
        if check is None:
            await self.relay.start()
            return
        # The engine's request first: the check's own CPU then overlaps the prefill rather
        # than delaying the request (tasks run in the order they were made).
        starting = asyncio.ensure_future(self.relay.start())
        checking = asyncio.ensure_future(check(call.parsed, call.key))
        refusal: str | None = None
        try:
            done, _ = await asyncio.wait((checking, starting), return_when=asyncio.FIRST_COMPLETED)
            if starting in done:
                starting.result()  # the engine's failure first: the check is moot
            refusal = await checking
            if refusal is None:
                await starting
        finally:
            pending = [task for task in (checking, starting) if not task.done()]
            for task in pending:
                task.cancel()  # a refusal closes the engine's request at once
            await asyncio.gather(*pending, return_exceptions=True)
        if refusal is not None:
            if call.state.live:
                call.fail(refusal, outcome=State.FILTERED)
            raise input_refused(refusal)

    def __aiter__(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The answer's batches of chunks; through the output filter if there is one (and
        straight from the relay, at no cost, if not). An answer the response cache will keep
        is recorded as the engine made it: a hit is screened by the policy of its day."""
        source = self.relay.__aiter__()
        ticket = self.call.cache
        if ticket is not None and ticket.recording:
            source = self._recorded(source, ticket)
        if self.output_filter is None:
            return source
        return self._screened(self.output_filter, source)

    async def _recorded(
        self, source: AsyncGenerator[list[dict[str, Any]]], ticket: cache.Ticket
    ) -> AsyncGenerator[list[dict[str, Any]]]:
        call = self.call
        whole: responses.Whole | None = responses.Whole(
            chat=call.parsed.endpoint == "chat.completions",
            limit=settings.INFERPLANE_RESPONSE_CACHE_MAX_ENTRY_BYTES,
        )
        try:
            async for batch in source:
                if whole is not None:
                    try:
                        for chunk in batch:
                            whole.add(chunk)
                    except responses.ResponseTooLarge:
                        whole = None  # too large to keep: relayed all the same
                yield batch
        finally:
            await source.aclose()
        if whole is not None and call.state is State.DONE:
            cache.keep(
                ticket, whole.result(model="", fallback_id="", created=0, usage=call.usage())
            )

    async def _screened(
        self, screen: OutputFilter, relayed: AsyncGenerator[list[dict[str, Any]]]
    ) -> AsyncGenerator[list[dict[str, Any]]]:
        call = self.call
        parsed = call.parsed
        finished: set[int] = set()
        head: tuple[str, int] | None = None  # the answer's id and creation time
        verdict = Screened([])
        try:
            async for batch in relayed:
                if head is None and batch:
                    head = (str(batch[0].get("id", "")), int(batch[0].get("created", 0)))
                verdict = await screen.screen(batch)
                if verdict.release:
                    _note_finished(verdict.release, finished)
                    yield verdict.release
                if verdict.cut is not None:
                    break
            else:
                verdict = await screen.end()
                if verdict.release:
                    _note_finished(verdict.release, finished)
                    yield verdict.release
        finally:
            await relayed.aclose()
        if verdict.cut is None:
            return
        call.fail(verdict.cut, outcome=State.FILTERED)
        rid, created = head or (f"cmpl-{call.rid}", int(call.started_at.timestamp()))
        chat = parsed.endpoint == "chat.completions"
        ending = cut_chunks(
            chat=chat,
            model=parsed.model,
            rid=rid,
            created=created,
            unfinished=[i for i in range(parsed.sequences) if i not in finished],
            usage=None,
            null_usage=parsed.include_usage and chat,
        )
        if ending:
            yield ending  # the client learns of the cut at once
        await self.relay.stop()  # vLLM aborts; what it made is counted
        if parsed.include_usage:
            yield cut_chunks(
                chat=chat,
                model=parsed.model,
                rid=rid,
                created=created,
                unfinished=[],
                usage=call.usage(),
                null_usage=False,
            )

    async def whole(self) -> dict[str, Any]:
        """The non-streamed answer (``responses.Whole``), or the ``ApiError`` to answer."""
        call = self.call
        chat = call.parsed.endpoint == "chat.completions"
        ticket = call.cache
        if call.parsed.endpoint == "embeddings" and isinstance(self.relay, Replay):
            call.end()  # the stored vectors, whole
            return {
                "object": "list",
                "data": self.relay.entry["data"],
                "model": call.parsed.model,
                "usage": self.relay.usage(),
            }
        if call.parsed.endpoint == "embeddings" and self.relay.answer is not None:
            answer = responses.embeddings_answer(
                self.relay.answer, model=call.parsed.model, prompt_tokens=call.counts.prompt
            )
            if ticket is not None and ticket.recording:
                cache.keep_embeddings(ticket, answer)
            return answer
        if self.relay.answer is not None:  # the engine answered whole (``Call.whole``)
            return responses.whole_answer(
                self.relay.answer, chat=chat, model=call.parsed.model, usage=call.usage()
            )
        whole = responses.Whole(chat=chat, limit=responses.answer_limit(call.mode))
        try:
            async for batch in self:
                for chunk in batch:
                    whole.add(chunk)
        except MidStreamError as exc:
            raise ApiError(502, str(exc), type="server_error", code="engine_failed") from exc
        except responses.ResponseTooLarge as exc:
            # Stop here: closing the engine's stream (settle) aborts the rest of the work.
            call.fail("non-streamed response too large")
            raise responses.too_large(exc.args[0]) from exc
        return whole.result(
            model=call.parsed.model,
            fallback_id=f"cmpl-{call.rid}",
            created=int(call.started_at.timestamp()),
            usage=self.relay.usage(),
        )

    async def __aenter__(self) -> Lifecycle:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        gone = exc_type is not None and issubclass(exc_type, asyncio.CancelledError | ClientGone)
        await asyncio.shield(self._settle(cancelled=gone))

    async def _settle(self, *, cancelled: bool) -> None:
        call, guard = self.call, self.guard
        try:
            if cancelled or call.state is State.FILTERED:
                await self.relay.drain()
        finally:  # whatever the drain met, the call is metered and what it holds released
            try:
                await self.relay.close()
            finally:
                try:
                    if guard is not None:  # its checks' tokens count toward the limits too
                        call.beside = await guard.spent(mode=call.mode)
                finally:
                    try:
                        await finish(call, cancelled=cancelled)
                    finally:
                        if guard is not None:
                            await guard.settle(mode=call.mode, ledger=call.ledger)


def _note_finished(chunks: list[dict[str, Any]], finished: set[int]) -> None:
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                finished.add(int(choice.get("index") or 0))
