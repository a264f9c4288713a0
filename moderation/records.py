"""What the guard leaves behind: its events (through a Redis stream into Postgres), its
verdicts in the metrics, and the ledger's records of a guard model's work with their cost."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import orjson
from redis.exceptions import RedisError

from billing.pricing import price_of
from contract import UsageRecord, price_in_force
from inference.gateway import metrics
from inference.gateway.auth import KeyInfo
from inference.gateway.catalog import catalog_view
from inference.gateway.redis import redis_async
from moderation.cascade import Assessment, Cascade, GuardUse
from moderation.services import EVENTS_STREAM

log = logging.getLogger(__name__)


async def record_event(
    cascade: Cascade,
    *,
    key: KeyInfo,
    rid: str,
    where: str,
    found: Assessment,
    text: str,
) -> None:
    """One event, through the Redis stream the worker moves into Postgres
    (``moderation_events_flush``); the text only when the tenant opted in."""
    event = {
        "tenant_id": cascade.tenant_id,
        "request_id": rid,
        "where": where,
        "action": found.action or "log",
        "categories": found.categories,
        "rules": found.rules,
        "failure": found.failure,
        "text": text[:4000] if cascade.spec.store_text else "",
        "key_prefix": key.prefix,
        "at": time.time(),
    }
    try:
        await redis_async().xadd(EVENTS_STREAM, {"e": orjson.dumps(event)})
    except RedisError:
        log.warning("moderation event lost (Redis unavailable): %s", event | {"text": ""})


def moderation_checked(stage: str, found: Assessment, seconds: float | None = None) -> None:
    """A check's verdict in the gateway's metrics (``inferplane_moderation_checks_total``)."""
    metrics.moderation_checked(
        stage, action=found.action, failed=bool(found.failure), seconds=seconds
    )


async def guard_cost(key: KeyInfo, model_name: str, tokens: int, *, batch: bool = False) -> int:
    """What a guard model's tokens cost at the catalog's price (the ledger prices the record
    itself, with the same arithmetic): for the key's spend budgets."""
    if not tokens:
        return 0
    catalog = await catalog_view().for_tenant(key.tenant_id)
    model = catalog.models.get(model_name)
    rates = price_in_force(model.prices, tenant_id=key.tenant_id, at=time.time()) if model else None
    return price_of(rates, prompt_tokens=tokens, completion_tokens=0, batch=batch)


def guard_record(
    *, rid: str, key: KeyInfo, model: str, use: GuardUse, mode: str, started_at: datetime
) -> UsageRecord:
    """The ledger's record of a guard model's work: prompt tokens, on the guard model."""
    finished = datetime.now(UTC)
    return UsageRecord(
        request_id=rid,
        tenant_id=key.tenant_id,
        api_key_id=key.key_id,
        model=model,
        endpoint="moderations",
        mode=mode,
        status="ok",
        prompt_tokens=use.tokens,
        pool=use.pool,
        replica=use.replica,
        duration_ms=int((finished - started_at).total_seconds() * 1000),
        started_at=started_at,
        finished_at=finished,
    )
