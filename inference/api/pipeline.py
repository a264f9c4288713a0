"""One request through the gateway, whatever the transport (SSE, JSON, WebSocket).

prepare():  authenticate → validate → resolve the model → limits → admission (a replica)
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
from redis.exceptions import NoScriptError, RedisError

from billing.pricing import cost_micros, rates_in_force
from inference.api import limits, lora, metering
from inference.api.admission import W_IN, W_OUT, CatalogMissing, admission
from inference.api.auth import KeyInfo, authenticate
from inference.api.catalog import catalog_view
from inference.api.errors import ApiError, model_not_found, overloaded
from inference.api.redis import redis_async
from inference.api.schema import ParsedRequest, check_max_tokens, parse_request, upstream_body
from inference.api.upstream import (
    PATHS,
    TRANSPORT_ERRORS,
    engine_error,
    engine_session,
    sse_batches,
)

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_ESTIMATE = 256  # tokens assumed when max_tokens is not given
PROGRESS_SECONDS = 1.0  # how often a running request's output tokens are charged
MAX_ATTEMPTS = 3
RETRY_PAUSE_SECONDS = 0.2
DRAIN_IDLE_SECONDS = 0.05
DRAIN_CAP_SECONDS = 0.25
# Fields vLLM adds to OpenAI's chunk shape.
_EXTRA_TOP = ("prompt_token_ids", "prompt_text", "kv_transfer_params")
_EXTRA_CHOICE = ("token_ids",)


class MidStreamError(Exception):
    """The engine failed after the response had started."""


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


async def prepare(*, authorization: str, raw_body: bytes, endpoint: str) -> Call:
    t0 = time.perf_counter()
    started_at = datetime.now(UTC)
    key = await authenticate(authorization)
    parsed = parse_request(raw_body, endpoint)
    view = catalog_view()
    catalog = await view.get()
    pool_name, base_name, model, adapter = _resolve(catalog, parsed.model, key)
    max_tokens = check_max_tokens(
        parsed,
        context_length=model["context_length"],
        tenant_cap=key.limit("max_tokens_per_request"),
    )
    rid = uuid.uuid4().hex
    estimate = parsed.prompt_estimate + (max_tokens or DEFAULT_COMPLETION_ESTIMATE)
    grant = await limits.acquire(key, rid=rid, estimate=estimate)
    pool = catalog["pools"][pool_name]
    try:
        replica = await _admit(view, pool_name, pool, rid, key, parsed, grant, adapter)
    except BaseException:
        await asyncio.shield(_release_quietly(grant))
        raise
    if replica not in pool["replicas"]:  # a replica newer than our copy of the catalog
        await view.refresh()
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
        rates=rates_in_force(
            model.get("prices"), tenant_id=key.tenant_id, at=started_at.timestamp()
        ),
        base_model=base_name,
        adapter=adapter,
        max_loras=pool.get("max_loras", 1),
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
                adapter=adapter.engine_name if adapter else "",
            )
        except CatalogMissing:
            if attempt:
                break
            await view.refresh(republish=True)
        except RedisError:
            log.warning("admission unavailable", exc_info=True)
            break
    raise overloaded(2, "Admission is unavailable for a moment. Retry shortly.")


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

    async def start(self) -> None:
        """Connect and wait for the engine's first event, failing over between replicas."""
        call = self.call
        session = engine_session()
        path = PATHS[call.parsed.endpoint]
        headers = {"content-type": "application/json", "x-request-id": call.rid}
        reloaded = False
        for _attempt in range(MAX_ATTEMPTS):
            call.replica_url = url = call.replicas.get(call.replica, {}).get("url", "")
            try:
                if call.adapter is not None:
                    await self._adapter_onto_replica(call.adapter)
                try:
                    response = await session.post(url + path, data=call.body, headers=headers)
                except aiohttp.ServerDisconnectedError:
                    # Most likely a pooled keep-alive connection the engine had just closed:
                    # one fresh try on the same replica before calling it failed.
                    response = await session.post(url + path, data=call.body, headers=headers)
            except (*TRANSPORT_ERRORS, lora.ReplicaUnreachable) as exc:
                await self._failover(f"{type(exc).__name__}: {exc}")
                continue
            self.response = response  # from here on, close() aborts it whatever happens
            if response.status != 200:
                body = await response.read()
                response.release()
                self.response = None
                if response.status == 404 and call.adapter is not None and not reloaded:
                    # The engine does not hold the adapter after all (it restarted since
                    # the last probe): load it again there, once.
                    reloaded = True
                    await self._forget_adapter(call.adapter)
                    continue
                if response.status >= 500 or response.status == 404:
                    await self._failover(f"HTTP {response.status}")
                    continue
                call.status, call.error = "error", f"engine refused: HTTP {response.status}"
                raise engine_error(response.status, body)
            self.batches = batches = sse_batches(response)
            try:
                first = await anext(batches)
            except (*TRANSPORT_ERRORS, StopAsyncIteration) as exc:
                response.close()
                self.response = self.batches = None
                await self._failover(f"no answer: {type(exc).__name__}")
                continue
            self.first = first
            call.ttft_ms = int((time.perf_counter() - call.t0) * 1000)
            self.last_progress = time.monotonic()
            return
        call.status, call.error = "error", "no replica answered"
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
            call.status, call.error = "error", "adapter bookkeeping unavailable"
            raise overloaded(2, "Adapters cannot be placed for a moment. Retry shortly.") from None
        except ApiError as exc:  # the engine refused the adapter, or its load takes too long
            call.status, call.error = "error", exc.message[:300]
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
        call.error = reason[:300]
        self.failures += 1
        try:
            replica = await admission().reroute(pool=call.pool, rid=call.rid, failed=call.replica)
        except RedisError:
            replica = ""
        if not replica:
            call.status = "error"
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
        model = call.parsed.model
        batch = self.first
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
                    self._count(chunk.pop("usage", None))
                    for name in _EXTRA_TOP:
                        chunk.pop(name, None)
                    chunk["model"] = model
                    choices = chunk.get("choices")
                    if choices:
                        for choice in choices:
                            for name in _EXTRA_CHOICE:
                                choice.pop(name, None)
                        if include_usage:
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
                    batch = await anext(self.batches)
                except StopAsyncIteration:
                    call.done = True  # ended without [DONE]; vLLM always sends it
                    return
        except (*TRANSPORT_ERRORS, MidStreamError) as exc:
            call.status = "error"
            call.error = f"engine failed mid-stream: {type(exc).__name__}: {exc}"[:300]
            raise MidStreamError(call.error) from exc

    def _count(self, usage: dict[str, Any] | None) -> None:
        """The engine's running totals for this request (continuous usage stats)."""
        if usage:
            call = self.call
            call.prompt_tokens = usage.get("prompt_tokens") or 0
            call.completion_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            call.cached_tokens = details.get("cached_tokens") or 0

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
                    self._count(orjson.loads(data).get("usage"))
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
    if cancelled and call.status == "ok" and not call.done:
        call.status = "cut_off"
    elif call.status == "ok" and not call.done:
        call.status = "error"
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
        "replica": call.replica_url,
        "ttft_ms": call.ttft_ms,
        "duration_ms": int((time.perf_counter() - call.t0) * 1000),
        "error": call.error,
        "started_at": call.started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
    }
    tokens = call.prompt_tokens + call.completion_tokens
    cost = _cost(call)
    try:
        # Slot, limits and ledger in one round trip.
        pipe = redis_async().pipeline(transaction=False)
        if call.replica:
            admission().complete_into(pipe, pool=call.pool, rid=call.rid, adjustment=adjustment)
        if call.adapter is not None and call.adapter_replica:
            lora.unuse_into(
                pipe, call.pool, call.adapter_replica, call.adapter.engine_name, call.rid
            )
        call.grant.release_into(pipe, tokens, cost)
        metering.spool_into(pipe, record)
        await pipe.execute()
    except NoScriptError:  # Redis restarted since the scripts were loaded: one by one
        try:
            if call.replica:
                await admission().complete(pool=call.pool, rid=call.rid, adjustment=adjustment)
            if call.adapter is not None and call.adapter_replica:
                await lora.unuse(
                    call.pool, call.adapter_replica, call.adapter.engine_name, call.rid
                )
            await call.grant.release(tokens, cost)
            await metering.spool(record)
        except RedisError:
            await metering.store_directly(record)
    except RedisError:
        log.warning("could not release admission/limits of %s", call.rid, exc_info=True)
        await metering.store_directly(record)


def _cost(call: Call) -> int:
    """What the call costs at the catalog's price, for the spend budgets (the ledger fixes
    the billed cost itself, with the same arithmetic)."""
    if not call.rates:
        return 0
    _, input_rate, cached_rate, output_rate, discount = call.rates
    return cost_micros(
        input_per_mtok=Decimal(input_rate),
        cached_input_per_mtok=Decimal(cached_rate),
        output_per_mtok=Decimal(output_rate),
        batch_discount_percent=Decimal(discount),
        batch=False,
        prompt_tokens=call.prompt_tokens,
        cached_tokens=call.cached_tokens,
        completion_tokens=call.completion_tokens,
    )


def aggregate(call: Call, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-streamed response, rebuilt from the engine's stream."""
    first = chunks[0] if chunks else {}
    chat = call.parsed.endpoint == "chat.completions"
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.get("choices") or ():
            index = c.get("index", 0)
            if chat:
                choice = choices.setdefault(
                    index,
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": None},
                        "logprobs": None,
                        "finish_reason": None,
                    },
                )
                _merge_delta(choice, c)
            else:
                choice = choices.setdefault(
                    index, {"index": index, "text": "", "logprobs": None, "finish_reason": None}
                )
                choice["text"] += c.get("text") or ""
                if c.get("logprobs"):
                    logprobs = choice["logprobs"] or {
                        "tokens": [],
                        "token_logprobs": [],
                        "top_logprobs": [],
                        "text_offset": [],
                    }
                    for name in logprobs:
                        logprobs[name].extend(c["logprobs"].get(name) or [])
                    choice["logprobs"] = logprobs
            if c.get("finish_reason"):
                choice["finish_reason"] = c["finish_reason"]
            if c.get("stop_reason") is not None:
                choice["stop_reason"] = c["stop_reason"]
    if chat:
        for choice in choices.values():
            message = choice["message"]
            if message["content"] is None and not message.get("tool_calls"):
                message["content"] = ""
    return {
        "id": first.get("id", f"cmpl-{call.rid}"),
        "object": "chat.completion" if chat else "text_completion",
        "created": first.get("created", int(call.started_at.timestamp())),
        "model": call.parsed.model,
        "choices": [choices[i] for i in sorted(choices)],
        "usage": call.usage(),
    }


def _merge_delta(choice: dict[str, Any], c: dict[str, Any]) -> None:
    delta = c.get("delta") or {}
    message = choice["message"]
    if delta.get("role"):
        message["role"] = delta["role"]
    for text_field in ("content", "reasoning_content", "reasoning", "refusal"):
        if delta.get(text_field) is not None:
            message[text_field] = (message.get(text_field) or "") + delta[text_field]
    for call in delta.get("tool_calls") or ():
        calls = message.setdefault("tool_calls", [])
        index = call.get("index", len(calls))
        while len(calls) <= index:
            calls.append(
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
        target = calls[index]
        if call.get("id"):
            target["id"] = call["id"]
        if call.get("type"):
            target["type"] = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            target["function"]["name"] += function["name"]
        if function.get("arguments"):
            target["function"]["arguments"] += function["arguments"]
    if c.get("logprobs") and c["logprobs"].get("content"):
        logprobs = choice["logprobs"] or {"content": []}
        logprobs["content"].extend(c["logprobs"]["content"])
        choice["logprobs"] = logprobs
