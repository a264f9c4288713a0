"""One request through the gateway, whatever the transport (SSE, JSON, WebSocket).

prepare():  (key authenticated by the transport) validate → resolve the model → limits →
            admission (a replica)
Relay:      send to the replica (another one if it fails before answering), then yield the
            engine's chunks cleaned to OpenAI's shape, charging output tokens as they come
finish():   meter with the engine's counts, release limits and the admission slot
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import orjson
from django.conf import settings
from redis.exceptions import RedisError

from billing.pricing import cost_micros
from contract import (
    Catalog,
    CatalogPool,
    CatalogReplica,
    PriceRow,
    Servable,
    UsageRecord,
    price_in_force,
)
from controlplane.logs import request_id_new, request_id_var
from inference.api import limits, lora, metering, metrics, responses
from inference.api.admission import W_IN, W_OUT, CatalogMissing, admission
from inference.api.auth import KeyInfo
from inference.api.catalog import catalog_view
from inference.api.errors import ApiError, invalid_request, model_not_found, overloaded
from inference.api.lua import Batch
from inference.api.responses import clean
from inference.api.salt import cache_salt, salted_prefix
from inference.api.schema import (
    ParsedRequest,
    check_content_parts,
    check_max_tokens,
    parse_request,
    upstream_body,
)
from inference.api.upstream import (
    ABORT_PATH,
    PATHS,
    TRANSPORT_ERRORS,
    SseBatches,
    engine_error,
    engine_request_ids,
    engine_session,
)
from inference.engine_auth import engine_auth_headers

log = logging.getLogger(__name__)
requests_log = logging.getLogger("inferplane.requests")

DEFAULT_COMPLETION_ESTIMATE = 256  # tokens assumed when max_tokens is not given
PROGRESS_SECONDS = 1.0  # how often a running request's output tokens are charged
MAX_ATTEMPTS = 3
RETRY_PAUSE_SECONDS = 0.2
DRAIN_IDLE_SECONDS = 0.05
DRAIN_CAP_SECONDS = 0.25
# After the engine took an abort: its last events (each sequence's finish_reason "abort",
# then the usage of all it generated) come within milliseconds. A pause of ABORTED_IDLE
# means it is not stopping them (ids it did not know: vLLM answers 200 to any), and the
# connection is closed, which aborts them; the whole wait is bounded by ABORTED_CAP.
ABORTED_IDLE_SECONDS = 1.0
ABORTED_CAP_SECONDS = 5.0
ABORT_ASK_SECONDS = 1.0
WATCH_SECONDS = 1.0  # how often a wait for a whole answer looks at its replica's health


# What runs before admission (``prepare``): (the request's id, the request as validated) ->
# None to let it queue for a replica, or the refusal the client gets.
Screen = Callable[[str, ParsedRequest], Awaitable[str | None]]


class MidStreamError(Exception):
    """The engine failed after the response had started."""


class Stalled(Exception):
    """The engine stopped sending mid-stream (a hung GPU, a stopped process, a partition)."""


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


class State(enum.Enum):
    """Where a call is. ``PREPARED`` (limits taken, admitted to a replica) → ``STREAMING``
    (the engine answered) → ``DONE`` (its ``[DONE]`` came); or, from either live state,
    ``FAILED`` (the engine or the gateway failed), ``CUT_OFF`` (the client left) or
    ``FILTERED`` (an output filter or input check stopped it, ``inference.api.seams``). A
    complete answer can still fail to reach the client whole (``DONE`` → ``FAILED`` | ``FILTERED``).
    Every ending is then ``SETTLED``: metered and released, once (``finish``)."""

    PREPARED = "prepared"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"
    CUT_OFF = "cut_off"
    FILTERED = "filtered"
    SETTLED = "settled"

    @property
    def live(self) -> bool:
        return self in _LIVE


_LIVE = frozenset({State.PREPARED, State.STREAMING})
_ENDINGS = frozenset({State.FAILED, State.CUT_OFF, State.FILTERED})
_NEXT: dict[State, frozenset[State]] = {
    State.PREPARED: frozenset({State.STREAMING, *_ENDINGS}),
    State.STREAMING: frozenset({State.DONE, *_ENDINGS}),
    State.DONE: frozenset({State.FAILED, State.FILTERED, State.SETTLED}),
    State.FAILED: frozenset({State.SETTLED}),
    State.CUT_OFF: frozenset({State.SETTLED}),
    State.FILTERED: frozenset({State.SETTLED}),
    State.SETTLED: frozenset(),
}
# The usage ledger's status for each way a call ends (billing.models.UsageRecord.Status).
LEDGER_STATUS = {
    State.DONE: "ok",
    State.FAILED: "error",
    State.CUT_OFF: "cut_off",
    State.FILTERED: "content_filter",
}


class IllegalTransition(RuntimeError):
    """A call was asked to move where its state machine does not go (a bug, not an input)."""


@dataclass(slots=True)
class Route:
    """Where a call runs: its pool, the replica admission gave it, the one last tried."""

    pool: str
    replicas: dict[str, CatalogReplica]  # the pool's replicas, from the catalog, by id
    replica: str
    replica_url: str = ""
    tried: str = ""  # the replica last sent to (the one that failed, if none is left)
    adapter_replica: str = ""  # the replica counting this request as using the adapter
    max_loras: int = 1  # adapters one replica of the pool holds at once


@dataclass(slots=True)
class Counts:
    """The engine's counts so far, summed over the request's sequences, and how much of
    the output admission has been charged already."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    progressed: int = 0
    ttft_ms: int | None = None


@dataclass(slots=True)
class Call:
    rid: str
    key: KeyInfo
    parsed: ParsedRequest
    route: Route
    served_name: str
    grant: limits.Grant
    body: bytes
    started_at: datetime
    t0: float
    headers: list[tuple[bytes, bytes]]
    counts: Counts = field(default_factory=Counts)
    state: State = State.PREPARED
    error: str = ""
    rates: PriceRow | None = None  # the price in force at the start
    base_model: str = ""  # the model billed: the base model under an adapter
    adapter: Adapter | None = None
    mode: str = "online"  # or "batch": billed at the batch discount
    # Where the usage record goes instead of the spool: a batch worker stores it with the
    # line's result, in one transaction (see ``batches``).
    ledger: Callable[[UsageRecord], None] | None = None
    # The engine answers whole, not streamed (a batch line: nobody watches it arrive, and a
    # whole answer costs the engine and us less per token); see ``Relay._post_whole``.
    whole: bool = False
    # What a failure is counted as in the metrics when the ledger status does not tell
    # (``errors.ERROR_KINDS``; empty: by status, see ``metrics.request_settled``).
    error_kind: str = ""
    # The routed name asked for, when a route (a canary) picked this call's target.
    routed_name: str = ""
    queue_wait: float = 0.0  # seconds it waited for admission
    # Work done for the call beside its engine (its guard's checks), as (tokens, their cost):
    # counted toward its limits and budgets when it is settled; billed on records of its own.
    beside: tuple[int, int] = (0, 0)

    def _move(self, to: State) -> None:
        if to not in _NEXT[self.state]:
            raise IllegalTransition(f"call {self.rid}: {self.state.name} -> {to.name}")
        self.state = to

    def streaming(self) -> None:
        """The engine answered: its first event is in."""
        self._move(State.STREAMING)

    def end(self) -> None:
        """The engine's answer is complete (its ``[DONE]``, or the end of its stream)."""
        self._move(State.DONE)

    def fail(self, error: str, *, outcome: State = State.FAILED) -> None:
        """The one place a call's outcome other than ``DONE`` is set: ``FAILED`` (the engine
        or the gateway failed), ``CUT_OFF`` (the client left first) or ``FILTERED``.
        ``settle()`` decides for a call that ended without any."""
        if outcome not in _ENDINGS:
            raise IllegalTransition(f"call {self.rid}: {outcome.name} is not a failure")
        self._move(outcome)
        self.error = error[:300]

    def note(self, error: str) -> None:
        """What went wrong on the way (a replica that failed before another one answered),
        kept with the record whatever the outcome."""
        self.error = error[:300]

    def settle(self, *, cancelled: bool) -> str | None:
        """Mark the call settled; its ledger status, or None if it was settled already. A
        call still live here ended before the engine's ``[DONE]`` with nothing noted: the
        client left (``cancelled``: a cut-off, billed for what was made), or the transport
        stopped reading for its own reason (an error)."""
        if self.state is State.SETTLED:
            return None
        if self.state.live:
            self.fail(self.error, outcome=State.CUT_OFF if cancelled else State.FAILED)
        status = LEDGER_STATUS[self.state]
        self._move(State.SETTLED)
        return status

    @property
    def replica_name(self) -> str:
        """The replica as tenants and the ledger know it (never its internal address)."""
        route = self.route
        replica = route.replica or route.tried
        known = route.replicas.get(replica)
        return known.name if known is not None and known.name else f"replica {replica}"

    def usage(self) -> dict[str, Any]:
        counts = self.counts
        return {
            "prompt_tokens": counts.prompt,
            "completion_tokens": counts.completion,
            "total_tokens": counts.prompt + counts.completion,
            "prompt_tokens_details": {"cached_tokens": counts.cached},
        }


@dataclass(frozen=True, slots=True)
class Adapter:
    """A tenant's LoRA adapter a request asked for (``<tenant-slug>/<name>[:version]``)."""

    engine_name: str  # what the engines know it as: ``<slug>/<name>:<version>``
    label: str  # ``<name>:<version>``, in the usage ledger
    path: str  # where the engines load it from


def _resolve(
    catalog: Catalog, name: str, key: KeyInfo, pool: str | None = None
) -> tuple[str, Servable, Adapter | None]:
    """(pool, what the tenant calls, adapter) for the ``model`` a request names
    (``Catalog.callable`` decides what a tenant may call): for a routed name (a canary), the
    target this request drew, which it keeps to its end. ``pool`` names the pool to run on
    instead of the model's online one (a batch line on a spot pool)."""
    target = catalog.route(name, random.random())  # noqa: S311 (a traffic split, not a secret)
    found = catalog.callable(target, key.tenant_id, routed=False)
    if found is None:
        raise model_not_found(name)
    if found.model.task != "generate":
        raise invalid_request(
            f"`{name}` is a classification model: it moderates text (POST /v1/moderations), "
            "it does not write any.",
            param="model",
        )
    adapter = None
    if found.adapter is not None:
        if not found.adapter.path:
            raise ApiError(
                503,
                f"`{name}` cannot be loaded onto the engines: adapter storage has no "
                "local files (see the README on adapter storage).",
                type="server_error",
                code="adapter_unavailable",
            )
        engine_name = found.adapter.engine_name
        adapter = Adapter(
            engine_name=engine_name,
            label=engine_name.rpartition("/")[2],
            path=found.adapter.path,
        )
    if pool is not None:
        given = catalog.pools.get(pool)
        if given is None or given.model != found.base:
            raise ApiError(
                503, f"Pool `{pool}` does not serve `{name}`.", type="server_error", code="no_pool"
            )
        return pool, found, adapter
    if found.pool is None:
        raise ApiError(
            503, f"No online pool serves `{name}` right now.", type="server_error", code="no_pool"
        )
    return found.pool, found, adapter


async def prepare(
    *,
    key: KeyInfo,
    raw_body: bytes,
    endpoint: str,
    pool: str | None = None,
    mode: str = "online",
    ledger: Callable[[UsageRecord], None] | None = None,
    whole: bool = False,
    rid: str = "",
    screen: Screen | None = None,
) -> Call:
    """Everything before the engine, for a request whose key was authenticated; on the
    model's online pool, or on ``pool`` (by name) when given. ``mode``, ``ledger`` and
    ``whole``: see ``Call``; ``rid``: the request's id, if the transport made it already.

    ``screen`` runs once the limits are taken (a refused request still counts toward the
    key's request rate) and before admission: what it refuses never waits for a replica.
    The call it refused comes back ``FILTERED``, holding no slot, its refusal as its error
    (the caller settles it: a ledger record with no tokens)."""
    t0 = time.perf_counter()
    started_at = datetime.now(UTC)
    parsed = parse_request(raw_body, endpoint)
    view = catalog_view()
    catalog = await view.for_tenant(key.tenant_id)
    pool_name, found, adapter = _resolve(catalog, parsed.model, key, pool)
    model = found.model
    pool_info = catalog.pools[pool_name]
    _check_fits(parsed, pool_info.max_inflight)
    check_content_parts(
        parsed,
        images=model.accepts_images,
        audio=model.accepts_audio,
        url_domains=settings.INFERPLANE_MEDIA_URL_DOMAINS,
    )
    max_tokens = check_max_tokens(
        parsed,
        context_length=model.context_length,
        tenant_cap=key.limit("max_tokens_per_request"),
    )
    # The id the transport made for this request (its early answers carried it), else a new
    # one; from here on every line this task logs carries it (controlplane.logs).
    if rid:
        request_id_var.set(rid)
    else:
        rid = request_id_new()
    salt = cache_salt(key.tenant_id, parsed.body.get("cache_salt"))
    served_name = adapter.engine_name if adapter else model.served_name
    # Before anything is held: a body the engine cannot be sent is refused with nothing to
    # give back.
    body = upstream_body(
        parsed, served_name=served_name, max_tokens=max_tokens, cache_salt=salt, whole=whole
    )
    completion_estimate = parsed.sequences * (max_tokens or DEFAULT_COMPLETION_ESTIMATE)
    rates = price_in_force(model.prices, tenant_id=key.tenant_id, at=started_at.timestamp())
    grant = await limits.acquire(
        key,
        rid=rid,
        estimate=parsed.prompt_estimate + completion_estimate,
        sequences=parsed.sequences,
        estimated_cost=price_of(
            rates,
            prompt_tokens=parsed.prompt_estimate,
            completion_tokens=completion_estimate,
            batch=mode == "batch",
        ),
    )
    queued_at = time.perf_counter()
    refusal: str | None = None
    try:
        if screen is not None:
            refusal = await screen(rid, parsed)
        replica = (
            ""  # refused: never admitted, never sent
            if refusal is not None
            else await _admit(
                view,
                pool_name,
                pool_info,
                rid,
                key,
                parsed,
                grant,
                adapter,
                salted_prefix(salt, parsed.prefix_hash),
            )
        )
    except BaseException:
        await asyncio.shield(_release_quietly(grant))
        raise
    # A replica newer than our copy of the catalog.
    if replica and replica not in pool_info.replicas:
        try:
            await view.refresh()
        except BaseException:  # the slot is ours already: give it back with the limits
            await asyncio.shield(_give_back(pool_name, rid, grant))
            raise
        pool_info = (view.data or catalog).pools.get(pool_name, pool_info)
    call = Call(
        rid=rid,
        key=key,
        parsed=parsed,
        route=Route(
            pool=pool_name,
            replicas=pool_info.replicas,
            replica=replica,
            max_loras=pool_info.max_loras,
        ),
        served_name=served_name,
        grant=grant,
        body=body,
        started_at=started_at,
        t0=t0,
        headers=[(b"x-request-id", rid.encode()), *grant.headers],
        rates=rates,
        base_model=found.base,
        adapter=adapter,
        routed_name=parsed.model if parsed.model in catalog.routes else "",
        mode=mode,
        ledger=ledger,
        whole=whole,
    )
    if refusal is not None:
        call.fail(refusal, outcome=State.FILTERED)
        return call
    metrics.queue_waited(call, time.perf_counter() - queued_at)
    return call


def _check_fits(parsed: ParsedRequest, capacity: int) -> None:
    """A request is as many sequences as the engine will run for it (prompts x n); one that
    a replica cannot run at once would hold a whole replica, or wait forever: refused."""
    if parsed.sequences > capacity:
        shape = f"{parsed.prompts} prompts x n={parsed.sequences // parsed.prompts}"
        raise invalid_request(
            f"This request runs {parsed.sequences} sequences at once ({shape}); a replica "
            f"of this model runs at most {capacity}. Send fewer prompts or a smaller n.",
            param="n" if parsed.prompts == 1 else "prompt",
            code="request_too_large",
        )


async def _admit(
    view: Any,
    pool_name: str,
    pool: CatalogPool,
    rid: str,
    key: KeyInfo,
    parsed: ParsedRequest,
    grant: limits.Grant,
    adapter: Adapter | None,
    prefix: str,
) -> str:
    """Admitted to a replica of the pool; ``prefix``: the request's salted prefix hash, for
    prefix-affine routing within the tenant's own cache partition."""
    for attempt in range(2):
        try:
            return await admission().admit(
                pool=pool_name,
                rid=rid,
                tenant=key.tenant_id,
                weight=key.weight,
                prompt_estimate=parsed.prompt_estimate,
                prefix=prefix,
                wait_seconds=pool.max_queue_wait_seconds,
                limit_keys=grant.conc_keys,
                limit_member=grant.member,
                adapter=adapter.engine_name if adapter else "",
                sequences=parsed.sequences,
            )
        except CatalogMissing:
            if attempt:
                break
            await view.refresh(republish=True)
        except RedisError:
            log.warning("admission unavailable", exc_info=True)
            break
    raise overloaded(2, "Admission is unavailable for a moment. Retry shortly.")


async def _give_back(pool: str, rid: str, grant: limits.Grant) -> None:
    try:
        await admission().complete(pool=pool, rid=rid, adjustment=0)
    except RedisError:
        log.warning("could not give back the slot of %s", rid, exc_info=True)
    await _release_quietly(grant)


async def _release_quietly(grant: limits.Grant) -> None:
    try:
        await grant.release(0)
    except RedisError:
        log.warning("could not release limits of %s", grant.rid, exc_info=True)


class Relay:
    """The engine's answer to one call, as batches of OpenAI-shaped chunks (a batch is what
    one read from the engine delivered: sending it as one write saves a syscall per chunk)."""

    def __init__(self, call: Call, tokens: dict[int, int] | None = None) -> None:
        """``tokens``: where the completion tokens by choice go (``completion_by_choice``),
        when something made before the relay reads them (a guard)."""
        self.call = call
        self.response: aiohttp.ClientResponse | None = None
        self.batches: AsyncIterator[list[bytes]] | None = None
        self.first: list[bytes] | None = None  # the engine's first event, until it is relayed
        self.read_to_end = False  # the engine's stream was read to its end ([DONE])
        self.last_progress = 0.0
        self.failures = 0
        self.completion_by_choice: dict[int, int] = {} if tokens is None else tokens
        self.prompt_by_prompt: dict[int, int] = {}
        self.answer: dict[str, Any] | None = None  # a whole answer (``Call.whole``)

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
        reloaded = False
        first_byte = settings.INFERPLANE_ENGINE_FIRST_BYTE_TIMEOUT_SECONDS
        loop = asyncio.get_running_loop()
        for _attempt in range(MAX_ATTEMPTS):
            call.route.tried = call.route.replica
            known = call.route.replicas.get(call.route.replica)
            call.route.replica_url = url = known.url if known is not None else ""
            try:
                if call.adapter is not None:
                    await self._adapter_onto_replica(call.adapter)
                if call.whole:
                    status, body = await self._post_whole(session, url + path, headers)
                    if status == 200:
                        self._take_whole(body)
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
            self.last_progress = time.monotonic()
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
            await self._forget_adapter(call.adapter)
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

    async def _post_whole(
        self, session: aiohttp.ClientSession, url: str, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """Send a request for a whole answer (``Call.whole``): its (status, body).

        The engine says nothing until its answer is complete, so the first-byte and stall
        bounds do not apply: the wait is watched instead. A replica that the health probe
        marks down meanwhile (dead, stopped, stuck: the catalog says so within seconds),
        or that leaves the pool, fails the request over at once (``Unanswered``); an answer
        slower than ``INFERPLANE_ENGINE_WHOLE_TIMEOUT_SECONDS`` is a 504 for this request
        alone (the replica is not blamed: slow is not dead)."""
        call = self.call
        limit = settings.INFERPLANE_ENGINE_WHOLE_TIMEOUT_SECONDS
        posting = asyncio.ensure_future(self._read_whole(session, url, headers))
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
        self, session: aiohttp.ClientSession, url: str, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """(status, body) of one non-streamed request: an answer up to its mode's bound
        (``responses.answer_limit``; past it, the 400 that online non-streamed answers
        give), an error up to 64 KiB."""
        try:
            response = await session.post(url, data=self.call.body, headers=headers)
        except aiohttp.ServerDisconnectedError:  # a pooled keep-alive connection just closed
            response = await session.post(url, data=self.call.body, headers=headers)
        limit = responses.answer_limit(self.call.mode) if response.status == 200 else 65536
        parts: list[bytes] = []
        size = 0
        try:
            async for part in response.content.iter_any():
                size += len(part)
                if size > limit:
                    if response.status == 200:
                        await self._too_large(response, parts, part, limit)
                    break
                parts.append(part)
        finally:
            if size > limit:
                response.close()
            else:
                response.release()
        return response.status, b"".join(parts)

    async def _too_large(
        self, response: aiohttp.ClientResponse, parts: list[bytes], part: bytes, limit: int
    ) -> None:
        """An answer past its bound: the engine made it whole, so it is billed whole. Its
        usage is the last object in it: the rest is read through, keeping only a tail, for
        that (the memory held stays the bound). Raises the 400 the client gets."""
        tail = (b"".join(parts[-4:]) + part)[-TAIL_BYTES:]
        parts.clear()
        async for more in response.content.iter_any():
            tail = (tail + more)[-TAIL_BYTES:]
        usage = _usage_in_tail(tail)
        counts = self.call.counts
        counts.prompt = usage.get("prompt_tokens") or 0
        counts.completion = usage.get("completion_tokens") or 0
        self.call.fail("non-streamed response too large")
        raise responses.too_large(limit)

    def _take_whole(self, body: bytes) -> None:
        """A whole answer: its counts are the engine's usage."""
        try:
            answer = orjson.loads(body)
            usage = answer.get("usage") or {}
        except (orjson.JSONDecodeError, AttributeError):
            raise Unanswered("its answer is not JSON") from None
        counts = self.call.counts
        counts.prompt = usage.get("prompt_tokens") or 0
        counts.completion = usage.get("completion_tokens") or 0
        counts.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self.answer = answer
        self.read_to_end = True
        self.call.streaming()
        self.call.end()

    async def _adapter_onto_replica(self, adapter: Adapter) -> None:
        """Make sure the chosen replica holds the request's adapter (loading it if not), and
        count the request as using it there, so that it is not evicted meanwhile."""
        call = self.call
        pool = call.route.pool
        try:
            held = False
            if call.route.adapter_replica != call.route.replica:
                if call.route.adapter_replica:
                    await lora.unuse(
                        pool, call.route.adapter_replica, adapter.engine_name, call.rid
                    )
                call.route.adapter_replica = (
                    call.route.replica
                )  # before: finish() unmarks it whatever
                held = await lora.use(pool, call.route.replica, adapter.engine_name, call.rid)
            if not held:
                await lora.load(
                    pool=pool,
                    replica=call.route.replica,
                    url=call.route.replica_url,
                    name=adapter.engine_name,
                    path=adapter.path,
                    capacity=call.route.max_loras,
                )
        except RedisError:
            log.warning("adapter bookkeeping unavailable", exc_info=True)
            call.fail("adapter bookkeeping unavailable")
            call.error_kind = "adapter_load"
            raise overloaded(
                2, "Adapters cannot be placed for a moment. Retry shortly.", kind="adapter_load"
            ) from None
        except ApiError as exc:  # the engine refused the adapter, or its load takes too long
            call.fail(exc.message)
            call.error_kind = exc.kind
            raise

    async def _forget_adapter(self, adapter: Adapter) -> None:
        try:
            await lora.forget(self.call.route.pool, self.call.route.replica, adapter.engine_name)
        except RedisError:
            log.warning("could not forget adapter %s", adapter.engine_name, exc_info=True)

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
        stall = settings.INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS
        gaps = metrics.TokenGaps()
        clock = time.perf_counter
        last = clock()
        try:
            while True:
                out = []
                for data in batch:
                    if data == b"[DONE]":
                        self.read_to_end = True
                        call.end()
                        break
                    chunk = orjson.loads(data)
                    if "choices" not in chunk and "error" in chunk:
                        message = str(chunk["error"].get("message", "engine error"))
                        raise MidStreamError(message[:300])
                    self._count(chunk.pop("usage", None), chunk.get("choices"))
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
                if time.monotonic() - self.last_progress >= PROGRESS_SECONDS:
                    await self._progress()
                try:
                    async with asyncio.timeout(stall):
                        batch = await anext(self.batches)
                    now = clock()
                    gaps.add(now - last)
                    last = now
                except StopAsyncIteration:  # ended without [DONE]; vLLM always sends it
                    self.read_to_end = True
                    call.end()
                    return
                except TimeoutError:
                    raise Stalled(f"the engine sent nothing for {stall} s") from None
        except Stalled as exc:
            call.fail(f"{call.replica_name}: engine stalled mid-stream: {exc}")
            await self._suspect()
            raise MidStreamError(call.error) from exc
        except (*TRANSPORT_ERRORS, MidStreamError) as exc:
            call.fail(f"{call.replica_name}: engine failed mid-stream: {_transport_reason(exc)}")
            raise MidStreamError(call.error) from exc
        finally:
            gaps.flush(call)

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
        in everything it generated, so the ledger holds the engine's own count.

        The engine is asked to abort the call's sequences by the request id the gateway gave
        it (vLLM's ``abort_requests``); it then ends each with ``finish_reason: "abort"`` and
        sends the usage of all it generated, which is read to the ``[DONE]`` (within
        ``ABORTED_CAP_SECONDS``). An engine that does not take the abort (one started
        without ``--enable-scale-out``) is read while data keeps coming without a pause of
        ``DRAIN_IDLE_SECONDS`` (up to ``DRAIN_CAP_SECONDS``), then closed, which aborts it:
        then the steps it was running when the connection closed are not billed.
        """
        if self.batches is None or self.read_to_end:
            return
        try:
            if self.first is not None:  # never relayed: its counts are the engine's too
                batch, self.first = self.first, None
                if self._count_raw(batch):
                    self.read_to_end = True
                    return
            idle, cap = DRAIN_IDLE_SECONDS, DRAIN_CAP_SECONDS
            if await self._abort():
                idle, cap = ABORTED_IDLE_SECONDS, ABORTED_CAP_SECONDS
            deadline = time.perf_counter() + cap
            while (remaining := deadline - time.perf_counter()) > 0:
                batch = await asyncio.wait_for(anext(self.batches), timeout=min(idle, remaining))
                if self._count_raw(batch):
                    self.read_to_end = True
                    return
        except (TimeoutError, StopAsyncIteration, *TRANSPORT_ERRORS, orjson.JSONDecodeError):
            return

    async def _abort(self) -> bool:
        """Ask the engine to abort this call's sequences; True if it took the request."""
        call = self.call
        ids = engine_request_ids(
            endpoint=call.parsed.endpoint, rid=call.rid, prompts=call.parsed.prompts
        )
        try:
            async with (
                asyncio.timeout(ABORT_ASK_SECONDS),
                engine_session().post(
                    call.route.replica_url + ABORT_PATH,
                    json={"request_ids": ids},
                    headers=engine_auth_headers(),
                ) as response,
            ):
                await response.read()
                return response.status == 200
        except (*TRANSPORT_ERRORS, TimeoutError):
            return False

    def _count_raw(self, batch: list[bytes]) -> bool:
        """Count a batch nobody will see; True at the engine's ``[DONE]``."""
        for data in batch:
            if data == b"[DONE]":
                return True
            chunk = orjson.loads(data)
            self._count(chunk.get("usage"), chunk.get("choices"))
        return False

    async def _progress(self) -> None:
        call = self.call
        self.last_progress = time.monotonic()
        delta = call.counts.completion - call.counts.progressed
        if delta <= 0:
            return
        try:
            await admission().progress(pool=call.route.pool, rid=call.rid, completion_tokens=delta)
            call.counts.progressed = call.counts.completion
        except RedisError:
            log.warning("could not charge progress of %s", call.rid)

    async def close(self) -> None:
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


async def finish(call: Call, *, cancelled: bool = False) -> None:
    """Meter the call and release everything it held. Runs once, shielded from cancellation."""
    status = call.settle(cancelled=cancelled)
    if status is None:
        return
    parsed = call.parsed
    adjustment = W_IN * (call.counts.prompt - parsed.prompt_estimate) + W_OUT * (
        call.counts.completion - call.counts.progressed
    )
    finished_at = datetime.now(UTC)
    duration = time.perf_counter() - call.t0
    record = UsageRecord(
        request_id=call.rid,
        tenant_id=call.key.tenant_id,
        api_key_id=call.key.key_id,
        model=call.base_model or parsed.model,
        adapter=call.adapter.label if call.adapter else "",
        route=call.routed_name,
        endpoint=parsed.endpoint,
        mode=call.mode,
        status=status,
        prompt_tokens=call.counts.prompt,
        completion_tokens=call.counts.completion,
        cached_tokens=call.counts.cached,
        pool=call.route.pool,
        replica=call.replica_name if call.route.replica_url else "",
        ttft_ms=call.counts.ttft_ms,
        duration_ms=int(duration * 1000),
        error=call.error,
        started_at=call.started_at,
        finished_at=finished_at,
    )
    tokens = call.counts.prompt + call.counts.completion
    cost = _cost(call)
    metrics.request_settled(call, status, duration, cost)
    _log_completion(record)
    try:
        # Slot, limits and ledger in one round trip (a Redis that lost the scripts gets them
        # loaded and only the scripts that failed run again: see inference.api.lua.Batch).
        pipe = Batch()
        if call.route.replica:
            admission().complete_into(
                pipe, pool=call.route.pool, rid=call.rid, adjustment=adjustment
            )
        if call.adapter is not None and call.route.adapter_replica:
            lora.unuse_into(
                pipe,
                call.route.pool,
                call.route.adapter_replica,
                call.adapter.engine_name,
                call.rid,
            )
        call.grant.release_into(pipe, tokens + call.beside[0], cost + call.beside[1])
        if call.ledger is None:
            metering.spool_into(pipe, record)
            metrics.spark_into(pipe, call, time.time())
        await pipe.execute()
    except RedisError:
        log.warning("could not release admission/limits of %s", call.rid, exc_info=True)
        if call.ledger is None:
            await metering.store_directly(record)
    if call.ledger is not None:
        call.ledger(record)


def _log_completion(record: UsageRecord) -> None:
    """The request's one completion line (logger ``inferplane.requests``): who, where, how it
    ended, how long, how many tokens — never the key's secret or a word of the prompt."""
    if not requests_log.isEnabledFor(logging.INFO):
        return
    fields = {
        "event": "completion",
        "tenant_id": record.tenant_id,
        "api_key_id": record.api_key_id,
        "pool": record.pool,
        "replica": record.replica,
        "model": record.model,
        "adapter": record.adapter,
        "endpoint": record.endpoint,
        "mode": record.mode,
        "status": record.status,
        "ttft_ms": record.ttft_ms,
        "duration_ms": record.duration_ms,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "cached_tokens": record.cached_tokens,
    }
    requests_log.info(
        " ".join(f"{name}={value}" for name, value in fields.items()),
        extra={**fields, "request_id": record.request_id},
    )


def price_of(
    rates: PriceRow | None,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    batch: bool = False,
) -> int:
    """What tokens cost at the catalog's price, for the spend budgets (the ledger fixes the
    billed cost itself, with the same arithmetic)."""
    if rates is None:
        return 0
    return cost_micros(
        input_per_mtok=rates.input_per_mtok,
        cached_input_per_mtok=rates.cached_input_per_mtok,
        output_per_mtok=rates.output_per_mtok,
        batch_discount_percent=rates.batch_discount_percent,
        batch=batch,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
    )


def _cost(call: Call) -> int:
    return price_of(
        call.rates,
        prompt_tokens=call.counts.prompt,
        completion_tokens=call.counts.completion,
        cached_tokens=call.counts.cached,
        batch=call.mode == "batch",
    )
