"""One request through the gateway, whatever the transport (SSE, JSON, WebSocket).

prepare():  (key authenticated by the transport) validate → resolve the model → limits →
            admission (a replica)
Relay:      send to the replica (another one if it fails before answering), then yield the
            engine's chunks cleaned to OpenAI's shape, charging output tokens as they come
finish():   meter with the engine's counts, release limits and the admission slot
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import aiohttp
import orjson
from django.conf import settings
from redis.exceptions import RedisError

from billing.pricing import cost_micros, rates_in_force
from inference.api import limits, lora, metering
from inference.api.admission import W_IN, W_OUT, CatalogMissing, admission
from inference.api.auth import KeyInfo
from inference.api.catalog import catalog_view
from inference.api.errors import ApiError, invalid_request, model_not_found, overloaded
from inference.api.lua import Batch
from inference.api.responses import clean
from inference.api.schema import (
    ParsedRequest,
    check_content_parts,
    check_max_tokens,
    parse_request,
    upstream_body,
)
from inference.api.upstream import (
    PATHS,
    TRANSPORT_ERRORS,
    engine_error,
    engine_session,
    sse_batches,
)
from inference.engine_auth import engine_auth_headers

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_ESTIMATE = 256  # tokens assumed when max_tokens is not given
PROGRESS_SECONDS = 1.0  # how often a running request's output tokens are charged
MAX_ATTEMPTS = 3
RETRY_PAUSE_SECONDS = 0.2
DRAIN_IDLE_SECONDS = 0.05
DRAIN_CAP_SECONDS = 0.25


class MidStreamError(Exception):
    """The engine failed after the response had started."""


class Stalled(Exception):
    """The engine stopped sending mid-stream (a hung GPU, a stopped process, a partition)."""


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


@dataclass(slots=True)
class Call:
    rid: str
    key: KeyInfo
    parsed: ParsedRequest
    pool: str
    served_name: str
    replicas: dict[str, Any]
    grant: limits.Grant
    replica: str
    body: bytes
    started_at: datetime
    t0: float
    headers: list[tuple[bytes, bytes]]
    replica_url: str = ""
    tried: str = ""  # the replica last sent to (the one that failed, if none is left)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    progressed: int = 0
    ttft_ms: int | None = None
    done: bool = False
    status: str = "ok"
    error: str = ""
    finished: bool = field(default=False)
    rates: list[Any] | None = None  # the price in force at the start (catalog row)
    base_model: str = ""  # the model billed: the base model under an adapter
    adapter: Adapter | None = None
    adapter_replica: str = ""  # the replica counting this request as using the adapter
    max_loras: int = 1  # adapters one replica of the pool holds at once

    def fail(self, error: str, *, status: str = "error") -> None:
        """The one place a call's outcome is set: ``error`` (the engine or the gateway
        failed) or ``cut_off`` (the client left first). ``finish()`` settles a call that
        ended without either."""
        self.status, self.error = status, error[:300]

    def note(self, error: str) -> None:
        """What went wrong on the way (a replica that failed before another one answered),
        kept with the record whatever the outcome."""
        self.error = error[:300]

    @property
    def replica_name(self) -> str:
        """The replica as tenants and the ledger know it (never its internal address)."""
        replica = self.replica or self.tried
        return str(self.replicas.get(replica, {}).get("name") or f"replica {replica}")

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class Adapter:
    """A tenant's LoRA adapter a request asked for (``<tenant-slug>/<name>[:version]``)."""

    engine_name: str  # what the engines know it as: ``<slug>/<name>:<version>``
    label: str  # ``<name>:<version>``, in the usage ledger
    path: str  # where the engines load it from


def _resolve(
    catalog: dict[str, Any], name: str, key: KeyInfo
) -> tuple[str, str, dict[str, Any], Adapter | None]:
    """(pool, base model name, base model, adapter) for the ``model`` a request names. Another
    tenant's adapter is as unknown as one that does not exist."""
    adapter = None
    base_name = name
    if "/" in name:
        address, _, version = name.partition(":")
        entry = catalog.get("adapters", {}).get(address)
        if entry is None or entry["tenant"] != key.tenant_id:
            raise model_not_found(name)
        if name.endswith(":"):
            raise model_not_found(name)
        found = entry["versions"].get(version or str(entry["latest"]))
        if found is None:
            raise model_not_found(name)
        if not found["path"]:
            raise ApiError(
                503,
                f"`{name}` cannot be loaded onto the engines: adapter storage has no "
                "local files (see the README on adapter storage).",
                type="server_error",
                code="adapter_unavailable",
            )
        base_name = found["model"]
        adapter = Adapter(
            engine_name=found["engine_name"],
            label=found["engine_name"].rpartition("/")[2],
            path=found["path"],
        )
    model = catalog["models"].get(base_name)
    if model is None or not (model["is_public"] or key.tenant_id in model["allowed_tenants"]):
        raise model_not_found(name)
    pool_name = model["online_pool"]
    if pool_name is None:
        raise ApiError(
            503, f"No online pool serves `{name}` right now.", type="server_error", code="no_pool"
        )
    return pool_name, base_name, model, adapter


async def prepare(*, key: KeyInfo, raw_body: bytes, endpoint: str) -> Call:
    """Everything before the engine, for a request whose key was authenticated."""
    t0 = time.perf_counter()
    started_at = datetime.now(UTC)
    parsed = parse_request(raw_body, endpoint)
    view = catalog_view()
    catalog = await view.get()
    pool_name, base_name, model, adapter = _resolve(catalog, parsed.model, key)
    pool = catalog["pools"][pool_name]
    _check_fits(parsed, pool["max_inflight"])
    check_content_parts(
        parsed,
        images=model.get("accepts_images", False),
        audio=model.get("accepts_audio", False),
        url_domains=settings.INFERPLANE_MEDIA_URL_DOMAINS,
    )
    max_tokens = check_max_tokens(
        parsed,
        context_length=model["context_length"],
        tenant_cap=key.limit("max_tokens_per_request"),
    )
    rid = uuid.uuid4().hex
    completion_estimate = parsed.sequences * (max_tokens or DEFAULT_COMPLETION_ESTIMATE)
    rates = rates_in_force(model.get("prices"), tenant_id=key.tenant_id, at=started_at.timestamp())
    grant = await limits.acquire(
        key,
        rid=rid,
        estimate=parsed.prompt_estimate + completion_estimate,
        sequences=parsed.sequences,
        estimated_cost=_price(
            rates, prompt_tokens=parsed.prompt_estimate, completion_tokens=completion_estimate
        ),
    )
    try:
        replica = await _admit(view, pool_name, pool, rid, key, parsed, grant, adapter)
    except BaseException:
        await asyncio.shield(_release_quietly(grant))
        raise
    if replica not in pool["replicas"]:  # a replica newer than our copy of the catalog
        try:
            await view.refresh()
        except BaseException:  # the slot is ours already: give it back with the limits
            await asyncio.shield(_give_back(pool_name, rid, grant))
            raise
        pool = (view.data or catalog)["pools"].get(pool_name, pool)
    return Call(
        rid=rid,
        key=key,
        parsed=parsed,
        pool=pool_name,
        served_name=adapter.engine_name if adapter else model["served_name"],
        replicas=pool["replicas"],
        grant=grant,
        replica=replica,
        body=upstream_body(
            parsed,
            served_name=adapter.engine_name if adapter else model["served_name"],
            max_tokens=max_tokens,
        ),
        started_at=started_at,
        t0=t0,
        headers=[(b"x-request-id", rid.encode()), *grant.headers],
        rates=rates,
        base_model=base_name,
        adapter=adapter,
        max_loras=pool.get("max_loras", 1),
    )


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
    pool: dict[str, Any],
    rid: str,
    key: KeyInfo,
    parsed: ParsedRequest,
    grant: limits.Grant,
    adapter: Adapter | None,
) -> str:
    for attempt in range(2):
        try:
            return await admission().admit(
                pool=pool_name,
                rid=rid,
                tenant=key.tenant_id,
                weight=key.weight,
                prompt_estimate=parsed.prompt_estimate,
                prefix=parsed.prefix_hash,
                wait_seconds=pool["max_queue_wait_seconds"],
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

    def __init__(self, call: Call) -> None:
        self.call = call
        self.response: aiohttp.ClientResponse | None = None
        self.batches: AsyncIterator[list[bytes]] | None = None
        self.first: list[bytes] | None = None
        self.last_progress = 0.0
        self.failures = 0
        self.completion_by_choice: dict[int, int] = {}
        self.prompt_by_prompt: dict[int, int] = {}

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
            call.tried = call.replica
            call.replica_url = url = call.replicas.get(call.replica, {}).get("url", "")
            try:
                if call.adapter is not None:
                    await self._adapter_onto_replica(call.adapter)
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
                if response.status == 404 and call.adapter is not None and not reloaded:
                    # The engine does not hold the adapter after all (it restarted since
                    # the last probe): load it again there, once.
                    reloaded = True
                    await self._forget_adapter(call.adapter)
                    continue
                if response.status in (401, 403):
                    # Our key, not the client's: the replica is misconfigured (its
                    # VLLM_API_KEY is not INFERPLANE_ENGINE_API_KEY). Never a 401 to them.
                    log.error("replica %s refuses the engine API key", call.replica_url)
                    await self._failover(f"HTTP {response.status}: the engine refused our key")
                    continue
                if response.status >= 500 or response.status == 404:
                    await self._failover(f"HTTP {response.status}")
                    continue
                call.fail(f"engine refused: HTTP {response.status}")
                raise engine_error(response.status, body)
            self.batches = batches = sse_batches(response)
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
            call.ttft_ms = int((time.perf_counter() - call.t0) * 1000)
            self.last_progress = time.monotonic()
            return
        call.fail("no replica answered")
        raise overloaded(2, "No replica could serve the request. Retry shortly.")

    async def _adapter_onto_replica(self, adapter: Adapter) -> None:
        """Make sure the chosen replica holds the request's adapter (loading it if not), and
        count the request as using it there, so that it is not evicted meanwhile."""
        call = self.call
        pool = call.pool
        try:
            held = False
            if call.adapter_replica != call.replica:
                if call.adapter_replica:
                    await lora.unuse(pool, call.adapter_replica, adapter.engine_name, call.rid)
                call.adapter_replica = call.replica  # before: finish() unmarks it whatever
                held = await lora.use(pool, call.replica, adapter.engine_name, call.rid)
            if not held:
                await lora.load(
                    pool=pool,
                    replica=call.replica,
                    url=call.replica_url,
                    name=adapter.engine_name,
                    path=adapter.path,
                    capacity=call.max_loras,
                )
        except RedisError:
            log.warning("adapter bookkeeping unavailable", exc_info=True)
            call.fail("adapter bookkeeping unavailable")
            raise overloaded(2, "Adapters cannot be placed for a moment. Retry shortly.") from None
        except ApiError as exc:  # the engine refused the adapter, or its load takes too long
            call.fail(exc.message)
            raise

    async def _forget_adapter(self, adapter: Adapter) -> None:
        try:
            await lora.forget(self.call.pool, self.call.replica, adapter.engine_name)
        except RedisError:
            log.warning("could not forget adapter %s", adapter.engine_name, exc_info=True)

    async def _failover(self, reason: str) -> None:
        """Move to another replica (the failed one leaves the rotation until a probe brings
        it back); when it is the pool's only replica, pause and try it again."""
        call = self.call
        log.warning("replica %s failed before answering (%s); rerouting", call.replica_url, reason)
        call.note(f"{call.replica_name}: {reason}")
        self.failures += 1
        try:
            replica = await admission().reroute(pool=call.pool, rid=call.rid, failed=call.replica)
        except RedisError:
            replica = ""
        if not replica:
            call.fail(call.error)
            call.replica = ""
            raise overloaded(2, "No replica could serve the request. Retry shortly.")
        if replica == call.replica:
            await asyncio.sleep(RETRY_PAUSE_SECONDS * self.failures)
        call.replica = replica

    async def __aiter__(self) -> AsyncIterator[list[dict[str, Any]]]:
        if self.batches is None or self.first is None:
            raise RuntimeError("Relay.start() must succeed before iterating")
        call = self.call
        include_usage = call.parsed.include_usage
        # Chat chunks carry "usage": null until the last one (OpenAI's chat chunk schema);
        # completion chunks share the completion object's shape, where usage is an object or
        # absent, so they leave it out.
        chat = call.parsed.endpoint == "chat.completions"
        null_usage = include_usage and chat
        model = call.parsed.model
        batch = self.first
        stall = settings.INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS
        try:
            while True:
                out = []
                for data in batch:
                    if data == b"[DONE]":
                        call.done = True
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
                if call.done:
                    return
                if time.monotonic() - self.last_progress >= PROGRESS_SECONDS:
                    await self._progress()
                try:
                    async with asyncio.timeout(stall):
                        batch = await anext(self.batches)
                except StopAsyncIteration:
                    call.done = True  # ended without [DONE]; vLLM always sends it
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
            call.prompt_tokens = sum(self.prompt_by_prompt.values())
            call.completion_tokens = sum(self.completion_by_choice.values())
        else:
            call.prompt_tokens = usage.get("prompt_tokens") or 0
            call.completion_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        if details:
            call.cached_tokens = details.get("cached_tokens") or 0

    async def _suspect(self) -> None:
        """The replica went silent mid-stream: out of rotation until a probe vouches for it."""
        try:
            await admission().suspect(pool=self.call.pool, replica=self.call.replica)
        except RedisError:
            log.warning("could not take replica %s out of rotation", self.call.replica)

    async def drain(
        self, *, idle: float = DRAIN_IDLE_SECONDS, cap: float = DRAIN_CAP_SECONDS
    ) -> None:
        """After the client left: take in what the engine already produced, then stop.

        The engine can run ahead of its own HTTP stream (outputs wait in its queue, merged),
        so tokens it generated may not have reached us yet. Reading while data keeps coming
        without a pause (up to ``cap``) puts them in the ledger; the first pause of ``idle``
        means we are level with generation, and closing then aborts it at once.
        """
        if self.batches is None or self.first is None or self.call.done:
            return
        deadline = time.perf_counter() + cap
        try:
            while (remaining := deadline - time.perf_counter()) > 0:
                batch = await asyncio.wait_for(anext(self.batches), timeout=min(idle, remaining))
                for data in batch:
                    if data == b"[DONE]":
                        return
                    chunk = orjson.loads(data)
                    self._count(chunk.get("usage"), chunk.get("choices"))
        except (TimeoutError, StopAsyncIteration, *TRANSPORT_ERRORS, orjson.JSONDecodeError):
            return

    async def _progress(self) -> None:
        call = self.call
        self.last_progress = time.monotonic()
        delta = call.completion_tokens - call.progressed
        if delta <= 0:
            return
        try:
            await admission().progress(pool=call.pool, rid=call.rid, completion_tokens=delta)
            call.progressed = call.completion_tokens
        except RedisError:
            log.warning("could not charge progress of %s", call.rid)

    async def close(self) -> None:
        if self.response is not None:
            if self.call.done:
                self.response.release()  # read to the end: the connection is reused
            else:
                # Closing mid-body drops the connection: vLLM aborts the sequence at once.
                self.response.close()


async def finish(call: Call, *, cancelled: bool = False) -> None:
    """Meter the call and release everything it held. Runs once, shielded from cancellation."""
    if call.finished:
        return
    call.finished = True
    if call.status == "ok" and not call.done:
        # Ended before the engine's [DONE] with no failure noted: the client left (a cut-off,
        # billed for what was made), or the transport stopped reading for its own reason.
        call.fail(call.error, status="cut_off" if cancelled else "error")
    parsed = call.parsed
    adjustment = W_IN * (call.prompt_tokens - parsed.prompt_estimate) + W_OUT * (
        call.completion_tokens - call.progressed
    )
    finished_at = datetime.now(UTC)
    record = {
        "request_id": call.rid,
        "tenant_id": call.key.tenant_id,
        "api_key_id": call.key.key_id,
        "model": call.base_model or parsed.model,
        "adapter": call.adapter.label if call.adapter else "",
        "endpoint": parsed.endpoint,
        "mode": "online",
        "status": call.status,
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": call.completion_tokens,
        "cached_tokens": call.cached_tokens,
        "pool": call.pool,
        "replica": call.replica_name if call.replica_url else "",
        "ttft_ms": call.ttft_ms,
        "duration_ms": int((time.perf_counter() - call.t0) * 1000),
        "error": call.error,
        "started_at": call.started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
    }
    tokens = call.prompt_tokens + call.completion_tokens
    cost = _cost(call)
    try:
        # Slot, limits and ledger in one round trip (a Redis that lost the scripts gets them
        # loaded and only the scripts that failed run again: see inference.api.lua.Batch).
        pipe = Batch()
        if call.replica:
            admission().complete_into(pipe, pool=call.pool, rid=call.rid, adjustment=adjustment)
        if call.adapter is not None and call.adapter_replica:
            lora.unuse_into(
                pipe, call.pool, call.adapter_replica, call.adapter.engine_name, call.rid
            )
        call.grant.release_into(pipe, tokens, cost)
        metering.spool_into(pipe, record)
        await pipe.execute()
    except RedisError:
        log.warning("could not release admission/limits of %s", call.rid, exc_info=True)
        await metering.store_directly(record)


def _price(
    rates: list[Any] | None, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> int:
    """What tokens cost at the catalog's price, for the spend budgets (the ledger fixes the
    billed cost itself, with the same arithmetic)."""
    if not rates:
        return 0
    _, input_rate, cached_rate, output_rate, discount = rates
    return cost_micros(
        input_per_mtok=Decimal(input_rate),
        cached_input_per_mtok=Decimal(cached_rate),
        output_per_mtok=Decimal(output_rate),
        batch_discount_percent=Decimal(discount),
        batch=False,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
    )


def _cost(call: Call) -> int:
    return _price(
        call.rates,
        prompt_tokens=call.prompt_tokens,
        completion_tokens=call.completion_tokens,
        cached_tokens=call.cached_tokens,
    )
