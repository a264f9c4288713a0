"""Relaying: send a call to its replica (another one if it fails before answering), then yield
the engine's chunks cleaned to OpenAI's shape, charging output tokens as they come. A whole
answer (a batch line) is fetched by ``whole``; the ledger is written by ``settle``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

import aiohttp
import orjson
from django.conf import settings
from redis.exceptions import RedisError

from inference.engine_auth import engine_auth_headers
from inference.gateway import lora, metrics
from inference.gateway.abort import abort_and_count
from inference.gateway.admission import admission
from inference.gateway.call import Call, MidStreamError, State
from inference.gateway.errors import lent_reclaimed, overloaded
from inference.gateway.responses import clean
from inference.gateway.upstream import (
    PATHS,
    TRANSPORT_ERRORS,
    SseBatches,
    Stalled,
    Watchdog,
    engine_error,
    engine_session,
)
from inference.gateway.whole import Unanswered, post_whole, take_whole

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 1.0  # how often a running request's output tokens are charged
MAX_ATTEMPTS = 3
RETRY_PAUSE_SECONDS = 0.2
# vLLM's per-request priority (it overrides one in the body), for engines that schedule by it.
PRIORITY_HEADER = "X-Vllm-Priority"
# The streams this process is relaying now (a crowd of them is coalesced: ``Relay.__aiter__``).
_relaying = [0]


def _transport_reason(exc: BaseException) -> str:
    """What went wrong with an engine's connection, for the ledger and the log. Tenants see
    the ledger's error: it must not name the replica's address (aiohttp's messages do)."""
    if isinstance(exc, lora.ReplicaUnreachable):
        return "ReplicaUnreachable: the engine could not be reached to load the adapter"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"{type(exc).__name__}: cannot connect ({exc.os_error.strerror or 'refused'})"
    if isinstance(exc, aiohttp.ClientResponseError | aiohttp.ServerDisconnectedError):
        return f"{type(exc).__name__}: the engine closed the connection"
    return f"{type(exc).__name__}: {exc}"[:300]


class Relay:
    """The engine's answer to one call, as batches of OpenAI-shaped chunks (a batch is what
    one read from the engine delivered: sending it as one write saves a syscall per chunk)."""

    def __init__(self, call: Call, tokens: dict[int, int] | None = None) -> None:
        """``tokens``: where the completion tokens by choice go (``completion_by_choice``),
        when something made before the relay reads them (a guard)."""
        self.call = call
        self.response: aiohttp.ClientResponse | None = None
        self.batches: SseBatches | None = None
        self.first: list[bytes] | None = None  # the engine's first event, until it is relayed
        self.read_to_end = False  # the engine's stream was read to its end ([DONE])
        self.last_progress = 0.0
        self.failures = 0
        self.completion_by_choice: dict[int, int] = {} if tokens is None else tokens
        self.prompt_by_prompt: dict[int, int] = {}
        self.answer: dict[str, Any] | None = None  # a whole answer (``Call.whole``)
        self.watchdog: Watchdog | None = None  # while the stream is relayed

    def usage(self) -> dict[str, Any]:
        """The answer's usage: the engine's counts."""
        return self.call.usage()

    async def start(self) -> None:
        """Connect and wait for the engine's first event, failing over between replicas."""
        call = self.call
        session = engine_session()
        path = PATHS[call.parsed.endpoint]
        headers = {
            "content-type": "application/json",
            "x-request-id": call.rid,
            **engine_auth_headers(),
        }
        if call.route.engine_priority is not None:  # set here only: a client's never passes
            headers[PRIORITY_HEADER] = str(call.route.engine_priority)
        reloaded = False
        first_byte = settings.INFERPLANE_ENGINE_FIRST_BYTE_TIMEOUT_SECONDS
        loop = asyncio.get_running_loop()
        for _attempt in range(MAX_ATTEMPTS):
            call.route.tried = call.route.replica
            known = call.route.replicas.get(call.route.replica)
            call.route.replica_url = url = known.url if known is not None else ""
            try:
                if call.adapter is not None:
                    await lora.onto_replica(call, call.adapter)
                if call.whole:
                    status, body = await post_whole(call, session, url + path, headers)
                    if status == 200:
                        self.answer = take_whole(call, body)
                        self.read_to_end = True
                        return
                    reloaded = await self._refused(status, body, reloaded=reloaded)
                    continue
                # A replica that accepts the connection and then says nothing (a hung GPU, a
                # stopped process, a partition without reset) is a failed replica.
                deadline = loop.time() + first_byte
                async with asyncio.timeout_at(deadline):
                    try:
                        response = await session.post(url + path, data=call.body, headers=headers)
                    except aiohttp.ServerDisconnectedError:
                        # Most likely a pooled keep-alive connection the engine had just
                        # closed: one fresh try on the same replica before calling it failed.
                        response = await session.post(url + path, data=call.body, headers=headers)
            except TimeoutError:
                await self._failover(f"no answer within {first_byte} s")
                continue
            except Unanswered as exc:
                await self._failover(str(exc))
                continue
            except (*TRANSPORT_ERRORS, lora.ReplicaUnreachable) as exc:
                await self._failover(_transport_reason(exc))
                continue
            self.response = response  # from here on, close() aborts it whatever happens
            if response.status != 200:
                # An error is a few hundred bytes: read at most 64 KiB of it, within the
                # same deadline (an engine that sends a status line and goes silent is a
                # silent engine).
                try:
                    async with asyncio.timeout_at(deadline):
                        body = await response.content.read(65536)
                except (*TRANSPORT_ERRORS, TimeoutError) as exc:
                    response.close()
                    self.response = None
                    await self._failover(f"HTTP {response.status}, then {_transport_reason(exc)}")
                    continue
                response.close()
                self.response = None
                reloaded = await self._refused(response.status, body, reloaded=reloaded)
                continue
            self.batches = batches = SseBatches(response)
            try:
                async with asyncio.timeout_at(deadline):
                    first = await anext(batches)
            except (*TRANSPORT_ERRORS, StopAsyncIteration) as exc:
                response.close()
                self.response = self.batches = None
                if isinstance(exc, TimeoutError):
                    await self._failover(f"no first token within {first_byte} s")
                else:
                    await self._failover(f"no answer: {_transport_reason(exc)}")
                continue
            self.first = first
            call.streaming()
            call.counts.ttft_ms = int((time.perf_counter() - call.t0) * 1000)
            self.last_progress = loop.time()
            return
        call.fail("no replica answered")
        raise overloaded(2, "No replica could serve the request. Retry shortly.")

    async def _refused(self, status: int, body: bytes, *, reloaded: bool) -> bool:
        """An engine's answer other than 200: the client's error (raised), or the replica's
        (failed over, or the adapter loaded again). Returns whether the adapter was."""
        call = self.call
        if status == 404 and call.adapter is not None and not reloaded:
            # The engine does not hold the adapter after all (it restarted since the last
            # probe): load it again there, once.
            await lora.forget_quietly(call, call.adapter)
            return True
        if status in (401, 403):
            # Our key, not the client's: the replica is misconfigured (its VLLM_API_KEY is
            # not INFERPLANE_ENGINE_API_KEY). Never a 401 to them.
            log.error("replica %s refuses the engine API key", call.route.replica_url)
            await self._failover(f"HTTP {status}: the engine refused our key")
        elif status >= 500 or status == 404:
            await self._failover(f"HTTP {status}")
        else:
            call.fail(f"engine refused: HTTP {status}")
            call.error_kind = "invalid_request" if status < 500 else "upstream"
            raise engine_error(status, body)
        return reloaded

    async def _failover(self, reason: str) -> None:
        """Move to another replica (the failed one leaves the rotation until a probe brings
        it back); when it is the pool's only replica, pause and try it again."""
        call = self.call
        log.warning(
            "replica %s failed before answering (%s); rerouting", call.route.replica_url, reason
        )
        call.note(f"{call.replica_name}: {reason}")
        self.failures += 1
        try:
            replica = await admission().reroute(
                pool=call.route.pool, rid=call.rid, failed=call.route.replica
            )
        except RedisError:
            replica = ""
        if replica is None and call.route.lent:
            # Its lent room was taken back as it failed: a lost room, not the line's failure
            # (``run_whole`` may not have heard of the reclaim yet).
            call.reclaimed = True
            call.fail("its lent room was taken back", outcome=State.CUT_OFF)
            call.route.replica = ""
            raise lent_reclaimed()
        if not replica:
            call.fail(call.error)
            call.route.replica = ""
            raise overloaded(2, "No replica could serve the request. Retry shortly.")
        if replica == call.route.replica:
            await asyncio.sleep(RETRY_PAUSE_SECONDS * self.failures)
        call.route.replica = replica

    async def __aiter__(self) -> AsyncGenerator[list[dict[str, Any]]]:
        if self.batches is None or self.first is None:
            raise RuntimeError("Relay.start() must succeed before iterating (once)")
        call = self.call
        include_usage = call.parsed.include_usage
        # Chat chunks carry "usage": null until the last one (OpenAI's chat chunk schema);
        # completion chunks share the completion object's shape, where usage is an object or
        # absent, so they leave it out.
        chat = call.parsed.endpoint == "chat.completions"
        null_usage = include_usage and chat
        model = call.parsed.model
        batch, self.first = self.first, None
        batches = self.batches
        loop = asyncio.get_running_loop()
        clock = loop.time
        # INFERPLANE_STREAM_COALESCE_MS: after a batch is written, the next read waits for
        # the interval's next tick; what the engine sends meanwhile goes out in one write
        # (the first token never waits). Only while this process relays at least
        # INFERPLANE_STREAM_COALESCE_FROM_STREAMS streams: one stream alone costs little CPU,
        # and its tokens go out as they come; a crowd's writes are what the CPU goes to.
        hold = settings.INFERPLANE_STREAM_COALESCE_MS  # in ms: the loop's clock counts them
        crowd = settings.INFERPLANE_STREAM_COALESCE_FROM_STREAMS
        self.watchdog = watchdog = Watchdog(
            batches, settings.INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS, loop
        )
        gaps = metrics.TokenGaps()
        loads, count = orjson.loads, self._count
        last = clock()
        _relaying[0] += 1
        try:
            while True:
                out = []
                for data in batch:
                    if data == b"[DONE]":
                        self.read_to_end = True
                        call.end()
                        break
                    chunk = loads(data)
                    if "choices" not in chunk and "error" in chunk:
                        message = str(chunk["error"].get("message", "engine error"))
                        raise MidStreamError(message[:300])
                    count(chunk.pop("usage", None), chunk.get("choices"))
                    if clean(chunk, model, chat):
                        if null_usage:
                            chunk["usage"] = None
                        out.append(chunk)
                    elif include_usage:
                        chunk["usage"] = call.usage()
                        out.append(chunk)
                if out:
                    yield out
                if self.read_to_end:
                    return
                now = clock()
                if now - self.last_progress >= PROGRESS_SECONDS:
                    await self._progress(now)
                if hold and _relaying[0] >= crowd:
                    # Until the next tick of the interval on the loop's clock, shared by all
                    # streams (a full interval when on one: uvloop's clock counts whole
                    # milliseconds, and float arithmetic would round a tick to just short of
                    # the next). The engine's events wait in the socket meanwhile.
                    wait = (hold - round(clock() * 1000) % hold) / 1000
                    transport = self._transport()
                    if transport is not None:
                        transport.pause_reading()
                    try:
                        await asyncio.sleep(wait)
                    finally:
                        if transport is not None and not transport.is_closing():
                            transport.resume_reading()
                try:
                    batch = await anext(batches)
                except StopAsyncIteration:  # ended without [DONE]; vLLM always sends it
                    self.read_to_end = True
                    call.end()
                    return
                now = clock()
                gaps.add(now - last)
                last = now
        except Stalled as exc:
            call.fail(f"{call.replica_name}: engine stalled mid-stream: {exc}")
            await self._suspect()
            raise MidStreamError(call.error) from exc
        except (*TRANSPORT_ERRORS, MidStreamError) as exc:
            call.fail(f"{call.replica_name}: engine failed mid-stream: {_transport_reason(exc)}")
            raise MidStreamError(call.error) from exc
        finally:
            _relaying[0] -= 1
            watchdog.stop()
            gaps.flush(pool=call.route.pool, model=call.base_model or call.parsed.model)

    def _transport(self) -> asyncio.ReadTransport | None:
        """The engine connection's transport (uvloop's is not an ``asyncio.Transport``
        subclass, but has its methods)."""
        connection = self.response.connection if self.response is not None else None
        transport = connection.transport if connection is not None else None
        return cast("asyncio.ReadTransport | None", transport)

    def _count(self, usage: dict[str, Any] | None, choices: list[dict[str, Any]] | None) -> None:
        """The engine's counts so far. Continuous usage stats are per sequence: a chunk of
        one choice carries that choice's completion tokens and its prompt's tokens, so the
        request's totals are summed over choices (prompts x n); the final usage chunk (no
        choices) carries the engine's totals for the whole request."""
        if not usage:
            return
        call = self.call
        if choices:
            index = int(choices[0].get("index") or 0)
            self.completion_by_choice[index] = usage.get("completion_tokens") or 0
            n = max(1, call.parsed.sequences // call.parsed.prompts)
            self.prompt_by_prompt[index // n] = usage.get("prompt_tokens") or 0
            call.counts.prompt = sum(self.prompt_by_prompt.values())
            call.counts.completion = sum(self.completion_by_choice.values())
        else:
            call.counts.prompt = usage.get("prompt_tokens") or 0
            call.counts.completion = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        if details:
            call.counts.cached = details.get("cached_tokens") or 0

    async def _suspect(self) -> None:
        """The replica went silent mid-stream: out of rotation until a probe vouches for it."""
        try:
            await admission().suspect(pool=self.call.route.pool, replica=self.call.route.replica)
        except RedisError:
            log.warning("could not take replica %s out of rotation", self.call.route.replica)

    async def drain(self) -> None:
        """After the client left (or a filter stopped the answer): stop the engine, and take
        in everything it generated, so the ledger holds the engine's own count
        (``inference.gateway.abort``)."""
        if self.watchdog is not None:
            self.watchdog.stop()  # the drain bounds its own waits
        if self.batches is None or self.read_to_end:
            return
        first, self.first = self.first, None  # never relayed: its counts are the engine's too
        self.read_to_end = await abort_and_count(self.call, self.batches, first, self._count_raw)

    def _count_raw(self, batch: list[bytes]) -> bool:
        """Count a batch nobody will see; True at the engine's ``[DONE]``."""
        for data in batch:
            if data == b"[DONE]":
                return True
            chunk = orjson.loads(data)
            self._count(chunk.get("usage"), chunk.get("choices"))
        return False

    async def _progress(self, now: float) -> None:
        call = self.call
        self.last_progress = now
        delta = call.counts.completion - call.counts.progressed
        if delta <= 0:
            return
        try:
            await admission().progress(pool=call.route.pool, rid=call.rid, completion_tokens=delta)
            call.counts.progressed = call.counts.completion
        except RedisError:
            log.warning("could not charge progress of %s", call.rid)

    async def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.response is not None:
            if self.read_to_end:
                self.response.release()  # read to the end: the connection is reused
            else:
                # Closing mid-body drops the connection: vLLM aborts the sequence at once.
                self.response.close()
            self.response = self.batches = None

    async def stop(self) -> None:
        """Stop the engine now (a filter cut the answer): drain what it made, then close."""
        await self.drain()
        await self.close()
