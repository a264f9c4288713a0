"""Per-tenant and per-key limits, checked and taken in one atomic Redis call.

RPM and TPM are token buckets refilled continuously over a minute; TPM takes an estimate
(prompt estimate + max_tokens) at admission and is corrected with the engine's count when
the request ends. Concurrency is a sorted set of leases (so a crashed process's slots come
back). The monthly token and spend budgets are counters seeded from the ledger when Redis
lacks them; a request is refused once a budget is used up (the one that crosses it is
served), and crossing 80% of a budget queues a warning (BUDGET_WARNINGS) that the drains
process turns into an audit event.

Every key of a tenant's limits (its keys' too) carries the tenant's hash tag
(``ip:rl:{t:<tenant>}:…``): each script touches one slot, on one Redis or a Redis Cluster.
"""

from __future__ import annotations

import calendar
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from django.db.models import F, Sum
from redis.exceptions import RedisError

from billing.budget_warnings import BUDGET_WARNINGS
from inference.gateway.auth import KeyInfo
from inference.gateway.db import run_db
from inference.gateway.errors import ApiError, overloaded
from inference.gateway.lua import Batch, Script
from inference.gateway.redis import redis_async
from tenants.keys import last_used_key, last_used_tenants_key

log = logging.getLogger(__name__)

LEASE_MS = 20_000


# KEYS: t_rpm t_tpm t_conc t_month k_rpm k_tpm k_conc k_month last_used t_spend k_spend
# ARGV: rid est lease_ms prefix, limits: t_rpm t_tpm t_conc t_month k_rpm k_tpm k_conc k_month
#       t_spend k_spend, then member (rid|sequences|est tokens|est cost) sequences est_cost
# Returns {status, reason, retry_ms, req_lim, req_rem, req_reset, tok_lim, tok_rem, tok_reset}
# status 1 = taken, 0 = refused, 2 = a monthly counter must be seeded first.
#
# t_conc / k_conc hold the requests in flight of the tenant / key whenever it has a
# concurrency or budget limit: a lease per request (so a crashed process's come back), named
# with what the request reserved. Concurrency counts their sequences; the budgets count what
# they may still use on top of what the ledger already counted, so concurrent requests
# cannot all pass a nearly spent budget.
ACQUIRE = Script("limits", "acquire")

# KEYS: t_tpm t_conc t_month k_tpm k_conc k_month t_spend k_spend
# ARGV: member est actual t_tpm_lim k_tpm_lim cost t_month_lim k_month_lim t_spend_lim
#       k_spend_lim tenant_id key_id month
# Returns the budget notices to queue (``billing.budget_warnings``): none, nearly always.
RELEASE = Script("limits", "release")


def _month() -> str:
    return datetime.now(UTC).strftime("%Y%m")


def _seconds_to_next_month() -> int:
    now = datetime.now(UTC)
    days = calendar.monthrange(now.year, now.month)[1]
    end = now.replace(day=days, hour=23, minute=59, second=59)
    return max(1, int((end - now).total_seconds()) + 1)


@dataclass(slots=True)
class Grant:
    """Limits taken for one request; ``release`` gives back what the request did not use."""

    key: KeyInfo
    rid: str
    estimate: int
    headers: list[tuple[bytes, bytes]]
    month: str
    conc_keys: tuple[str, ...]  # the in-flight leases this request holds (renewed while it runs)
    member: str  # its name in them: rid|sequences|estimated tokens|estimated cost

    def _release_args(self, actual_tokens: int, cost: int) -> tuple[list[str], list[Any]]:
        key = self.key
        t, k = _scopes(key, self.month)
        keys = [t["tpm"], t["conc"], t["month"], k["tpm"], k["conc"], k["month"]]
        keys += [t["spend"], k["spend"]]
        tl, kl = key.tenant_limits, key.key_limits
        args = [self.member, self.estimate, actual_tokens, tl[1], kl[1], cost, tl[4], kl[4]]
        return keys, [*args, tl[5], kl[5], key.tenant_id, key.key_id, self.month]

    async def release(self, actual_tokens: int, cost_micros: int = 0) -> None:
        """Give back the estimate's excess (or take the shortfall) and the concurrency slot;
        count the tokens and the spend against the monthly budgets."""
        pipe = Batch()
        self.release_into(pipe, actual_tokens, cost_micros)
        await pipe.execute()

    def release_into(self, pipe: Batch, actual_tokens: int, cost_micros: int = 0) -> None:
        """``release`` on ``pipe``'s round trip; a budget notice it returns (a crossing of
        80%, once a month per budget) costs one more. The tenant is named to the last-use
        flush every time (its stamp was written by ACQUIRE, in the tenant's slot): a set
        member added again costs nothing, and no stamp waits on one request's end."""
        keys, args = self._release_args(actual_tokens, cost_micros)
        pipe.script(RELEASE, keys, args, then=_queue_notices)
        pipe.sadd(last_used_tenants_key(self.key.tenant_id), self.key.tenant_id)


async def _queue_notices(notices: list[bytes]) -> None:
    if notices:
        try:
            await redis_async().rpush(BUDGET_WARNINGS, *notices)
        except RedisError:  # the counter is right; only the 80% e-mail is missed
            log.warning("could not queue budget notices: %s", notices)


def _scopes(key: KeyInfo, month: str) -> tuple[dict[str, str], dict[str, str]]:
    t = f"ip:rl:{{t:{key.tenant_id}}}:"
    k = f"{t}k:{key.key_id}:"
    return (
        {
            "rpm": t + "rpm",
            "tpm": t + "tpm",
            "conc": t + "conc",
            "month": f"{t}m:{month}",
            "spend": f"{t}s:{month}",
        },
        {
            "rpm": k + "rpm",
            "tpm": k + "tpm",
            "conc": k + "conc",
            "month": f"{k}m:{month}",
            "spend": f"{k}s:{month}",
        },
    )


def _duration(ms: int) -> str:
    """OpenAI's reset format: 20ms, 1s, 1.5s, 6m0s."""
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest}s"


def _headers(values: list[int]) -> list[tuple[bytes, bytes]]:
    req_lim, req_rem, req_reset, tok_lim, tok_rem, tok_reset = values
    headers: list[tuple[bytes, bytes]] = []
    if req_lim:
        headers += [
            (b"x-ratelimit-limit-requests", str(req_lim).encode()),
            (b"x-ratelimit-remaining-requests", str(req_rem).encode()),
            (b"x-ratelimit-reset-requests", _duration(req_reset).encode()),
        ]
    if tok_lim:
        headers += [
            (b"x-ratelimit-limit-tokens", str(tok_lim).encode()),
            (b"x-ratelimit-remaining-tokens", str(tok_rem).encode()),
            (b"x-ratelimit-reset-tokens", _duration(tok_reset).encode()),
        ]
    return headers


def _month_used_from_db(key: KeyInfo, per_key: bool, month: str, spend: bool) -> int:
    from billing.models import UsageRecord

    start = datetime(int(month[:4]), int(month[4:]), 1, tzinfo=UTC)
    records = UsageRecord.objects.filter(tenant_id=key.tenant_id, started_at__gte=start)
    if per_key:
        records = records.filter(api_key_id=key.key_id)
    if spend:
        total = records.aggregate(n=Sum("cost_micros"))["n"]
    else:
        total = records.aggregate(n=Sum(F("prompt_tokens") + F("completion_tokens")))["n"]
    return int(total or 0)


REJECTIONS_KEPT = 50

# Keys and tenants refused in the last REFUSED_SECONDS, in this process: their requests take
# the limits before asking admission (two round trips), so a client hammering past its limit
# never takes, even for a round trip, a place in a pool others wait for.
REFUSED_SECONDS = 10.0
_refused: dict[tuple[str, int], float] = {}


def refused_now(key: KeyInfo) -> None:
    until = time.monotonic() + REFUSED_SECONDS
    if len(_refused) > 10_000:  # bounded: the oldest half goes
        for old in sorted(_refused, key=_refused.__getitem__)[: len(_refused) // 2]:
            del _refused[old]
    _refused[("k", key.key_id)] = _refused[("t", key.tenant_id)] = until


def refused_lately(key: KeyInfo) -> bool:
    now = time.monotonic()
    return any(
        _refused.get(scope, 0.0) > now for scope in (("k", key.key_id), ("t", key.tenant_id))
    )


def rejections_key(tenant_id: int) -> str:
    """A tenant's latest refusals (JSON, newest first), for its dashboard."""
    return f"ip:rejections:{{t:{tenant_id}}}"


def rejection_counts_key(tenant_id: int, month: str) -> str:
    """A tenant's refusals this month by reason (hash)."""
    return f"ip:rejections:{{t:{tenant_id}}}:{month}"


async def _note_rejection(key: KeyInfo, reason: str, month: str) -> None:
    """Remember a 429 for the tenant's dashboard (only refused requests pay for this)."""
    note = orjson.dumps({"at": int(time.time()), "key": key.prefix, "reason": reason})
    pipe = redis_async().pipeline(transaction=False)
    pipe.lpush(rejections_key(key.tenant_id), note)
    pipe.ltrim(rejections_key(key.tenant_id), 0, REJECTIONS_KEPT - 1)
    pipe.expire(rejections_key(key.tenant_id), 40 * 86400)
    pipe.hincrby(rejection_counts_key(key.tenant_id, month), reason, 1)
    pipe.expire(rejection_counts_key(key.tenant_id, month), 40 * 86400)
    try:
        await pipe.execute()
    except RedisError:
        log.warning("could not note a rejection for tenant %s", key.tenant_id)


@dataclass(slots=True)
class Plan:
    """One request's ACQUIRE, ready to send (``acquire``, or beside admission's ENQUEUE in
    one round trip: ``inference.gateway.admission.Admission.admit``'s ``alongside``)."""

    key: KeyInfo
    rid: str
    estimate: int
    sequences: int
    month: str
    keys: list[str]
    args: list[Any]
    member: str
    conc_keys: tuple[str, ...]  # the in-flight leases a grant holds
    result: Any = None  # ACQUIRE's, once sent beside ENQUEUE

    @property
    def script(self) -> Script:
        return ACQUIRE

    def taken(self, result: Any) -> bool:
        """Whether ACQUIRE's ``result`` took the limits (an error, or none yet, did not)."""
        return isinstance(result, list) and int(result[0]) == 1

    def grant(self) -> Grant:
        """The grant of a plan ACQUIRE took (``result``): the headers it reported."""
        return Grant(
            key=self.key,
            rid=self.rid,
            estimate=self.estimate,
            headers=_headers([int(v) for v in self.result[3:]]),
            month=self.month,
            conc_keys=self.conc_keys,
            member=self.member,
        )


def plan(
    key: KeyInfo, *, rid: str, estimate: int, sequences: int = 1, estimated_cost: int = 0
) -> Plan:
    month = _month()
    member = f"{rid}|{sequences}|{estimate}|{estimated_cost}"
    t, k = _scopes(key, month)
    tl, kl = key.tenant_limits, key.key_limits
    # LIMIT_NAMES order: rpm, tpm, max_concurrency, max_tokens_per_request, monthly tokens, spend
    limits = [tl[0], tl[1], tl[2], tl[4], kl[0], kl[1], kl[2], kl[4], tl[5], kl[5]]
    keys = [t["rpm"], t["tpm"], t["conc"], t["month"], k["rpm"], k["tpm"], k["conc"], k["month"]]
    keys += [last_used_key(key.tenant_id), t["spend"], k["spend"]]
    return Plan(
        key=key,
        rid=rid,
        estimate=estimate,
        sequences=sequences,
        month=month,
        keys=keys,
        args=[rid, estimate, LEASE_MS, key.prefix, *limits, member, sequences, estimated_cost],
        member=member,
        conc_keys=tuple(
            scope["conc"]
            for scope, lim in ((t, tl), (k, kl))
            if lim[2] or lim[4] or lim[5]  # concurrency, monthly tokens, monthly spend
        ),
    )


async def acquire(
    key: KeyInfo, *, rid: str, estimate: int, sequences: int = 1, estimated_cost: int = 0
) -> Grant:
    """Take one request of ``sequences`` sequences and ``estimate`` tokens (costing up to
    ``estimated_cost`` micro-dollars) from every limit, or raise a 429."""
    planned = plan(
        key, rid=rid, estimate=estimate, sequences=sequences, estimated_cost=estimated_cost
    )
    return await take(planned)


async def take(planned: Plan) -> Grant:
    """``acquire`` of a plan made already."""
    return await decide(planned, await ACQUIRE(keys=planned.keys, args=planned.args))


async def decide(planned: Plan, result: Any) -> Grant:
    """The grant ACQUIRE's ``result`` gives, or its 429 raised; a monthly counter it found
    missing is seeded from the ledger and ACQUIRE runs again."""
    key, month = planned.key, planned.month
    t, k = _scopes(key, month)
    status, reason = int(result[0]), result[1].decode()
    # Each pass seeds one missing monthly counter (four at most: tokens and spend, tenant and
    # key), so the fifth ACQUIRE always decides.
    for _ in range(4):
        if status != 2:
            break
        per_key, spend = reason.startswith("seed_k"), reason.endswith("s")
        used = await run_db(_month_used_from_db, key, per_key, month, spend)
        await redis_async().set(
            (k if per_key else t)["spend" if spend else "month"],
            used,
            nx=True,
            ex=_seconds_to_next_month() + 86400,
        )
        result = await ACQUIRE(keys=planned.keys, args=planned.args)
        status, reason = int(result[0]), result[1].decode()
    if status == 2:  # counters keep vanishing (Redis being flushed): do not guess
        raise overloaded(1, "Usage limits are being rebuilt. Retry shortly.")
    estimate, sequences = planned.estimate, planned.sequences
    values = [int(v) for v in result[3:]]
    headers = _headers(values)
    if status == 1:
        planned.result = result
        return planned.grant()
    refused_now(key)
    await _note_rejection(key, reason, month)
    retry_ms = int(result[2])
    retry_after = max(1, -(-retry_ms // 1000))
    extra = {h.decode(): v.decode() for h, v in headers}
    if reason == "budget":
        raise ApiError(
            429,
            "You exceeded your monthly token budget. Ask your tenant admin to raise it.",
            type="insufficient_quota",
            code="insufficient_quota",
            headers=extra,
        )
    if reason == "spend":
        raise ApiError(
            429,
            "You exceeded your monthly spend budget. Ask your tenant admin to raise it.",
            type="insufficient_quota",
            code="insufficient_quota",
            headers=extra,
        )
    if reason == "concurrency":
        raise ApiError(
            429,
            "Too many requests in flight for this key or tenant. Wait for one to finish.",
            type="requests",
            code="rate_limit_exceeded",
            headers={**extra, "retry-after": "1"},
        )
    if reason == "conc_too_large":  # it could never run: not a 429 that clients retry
        raise ApiError(
            400,
            f"Request too large: it runs {sequences} sequences at once (prompts x n), and "
            f"this key or tenant may run {retry_ms} at a time. Send fewer prompts or a "
            "smaller n.",
            param="n",
            code="request_too_large",
        )
    if reason == "too_large":
        raise ApiError(
            429,
            f"Request too large: it may use up to {estimate} tokens, and the limit is "
            f"{values[3]} tokens per minute. Lower max_tokens or the prompt.",
            type="tokens",
            code="rate_limit_exceeded",
            headers=extra,
        )
    kind = "requests per minute" if reason == "requests" else "tokens per minute"
    raise ApiError(
        429,
        f"Rate limit reached ({kind}). Please try again in {_duration(retry_ms)}.",
        type=reason,
        code="rate_limit_exceeded",
        headers={**extra, "retry-after": str(retry_after)},
    )
