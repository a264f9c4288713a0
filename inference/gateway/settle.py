"""Settling: a call's end. ``finish`` meters it with the engine's counts (the usage record,
to the spool or the batch line's ledger), counts it in the metrics and the log, and releases
its admission slot, adapter use and limits in one round trip, exactly once."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from redis.exceptions import RedisError

from billing.pricing import price_of
from contract import (
    UsageRecord,
)
from inference.gateway import cache, lora, metering, metrics
from inference.gateway.admission import W_IN, W_OUT, admission
from inference.gateway.call import Call
from inference.gateway.lua import Batch

log = logging.getLogger(__name__)
requests_log = logging.getLogger("inferplane.requests")


async def finish(call: Call, *, cancelled: bool = False) -> None:
    """Meter the call and release everything it held. Runs once, shielded from cancellation."""
    status = call.settle(cancelled=cancelled)
    if status is None:
        return
    ticket = call.cache
    if status == "ok" and ticket is not None and ticket.hit:
        status = "cache_hit"  # no engine tokens: billed as a hit (docs/cache.md)
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
        endpoint=parsed.label,
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
        priority=call.priority,
    )
    tokens = call.counts.prompt + call.counts.completion
    cost = _cost(call)
    if call.reclaimed:  # nothing of it counts (it runs again, and counts then)
        tokens = cost = 0
        call.beside = (0, 0)
    metrics.request_settled(
        record,
        tenant_slug=call.key.tenant_slug,
        seconds=duration,
        error_kind=call.error_kind,
        cost_micros=cost,
    )
    _log_completion(record)
    try:
        # Slot, limits and ledger in one round trip (a Redis that lost the scripts gets them
        # loaded and only the scripts that failed run again: see inference.gateway.lua.Batch).
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
            metrics.spark_into(pipe, record, queue_wait=call.queue_wait, now=time.time())
        await pipe.execute()
    except RedisError:
        log.warning("could not release admission/limits of %s", call.rid, exc_info=True)
        if call.ledger is None:
            await metering.store_directly(record)
    if call.ledger is not None:
        call.ledger(record)
    if status == "ok" and ticket is not None and ticket.kept:
        await _keep(ticket)


async def _keep(ticket: cache.Ticket) -> None:
    """The answer into the tenant's response cache: a batch of its own, after the call's,
    so that a cache Redis cannot take (full, say) never touches the settling (each batch has
    its own results, even in a pipeline shared with others: ``lua.Batch``)."""
    try:
        pipe = Batch()
        cache.store_into(pipe, ticket)
        await pipe.execute()
    except RedisError:
        log.warning("could not keep an answer in the response cache", exc_info=True)


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


def _cost(call: Call) -> int:
    return price_of(
        call.rates,
        prompt_tokens=call.counts.prompt,
        completion_tokens=call.counts.completion,
        cached_tokens=call.counts.cached,
        batch=call.mode == "batch",
        priority=call.priority,
    )
