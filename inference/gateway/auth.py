"""API key authentication for the hot path: in-process cache → Redis → Postgres.

Steady state costs no database query and, within a second of the last look-up, no Redis
round trip either. See ``inference.keycache`` for how changes reach every process.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson

from inference.gateway.db import run_db
from inference.gateway.errors import ApiError, invalid_api_key
from inference.gateway.redis import redis_async
from inference.keycache import (
    ENTRY_SECONDS,
    KEY_ENTRY,
    TENANT_KEYS,
    TOMBSTONE,
    UNKNOWN,
    UNKNOWN_SECONDS,
)
from tenants.keys import digest_matches, key_parse
from tenants.models import ApiKey, LimitFields, Tenant, tighter
from tenants.priority import DEFAULT_CLASS

L1_SECONDS = 1.0
L1_MAX_ENTRIES = 50_000


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key_id: int
    prefix: str
    digest: str
    tenant_id: int
    tenant_slug: str
    weight: int
    scopes: frozenset[str]
    expires_at: float | None  # epoch seconds
    # In LimitFields.LIMIT_NAMES order; 0 means unlimited.
    tenant_limits: tuple[int, ...]
    key_limits: tuple[int, ...]
    # The tenant's response cache: (``off`` | ``exact`` | ``semantic`` | ``key-off``: the
    # tenant has one, this key stays out of it; its TTL in seconds; the semantic cache's
    # similarity threshold and embedding model).
    cache: tuple[str, int, float, str] = ("off", 0, 1.0, "")
    # The highest priority class its requests may run in (the key's, never above its
    # tenant's: ``tenants.priority``); a request may ask for a lower one.
    priority: str = DEFAULT_CLASS

    def limit(self, name: str) -> int:
        """The effective value of one limit (the tighter of key and tenant), 0 = none."""
        i = LimitFields.LIMIT_NAMES.index(name)
        return tighter(self.tenant_limits[i], self.key_limits[i]) or 0

    def to_json(self) -> bytes:
        return orjson.dumps(
            [
                self.key_id,
                self.prefix,
                self.digest,
                self.tenant_id,
                self.tenant_slug,
                self.weight,
                sorted(self.scopes),
                self.expires_at,
                list(self.tenant_limits),
                list(self.key_limits),
                list(self.cache),
                self.priority,
            ]
        )

    @classmethod
    def from_json(cls, raw: bytes) -> KeyInfo:
        v = orjson.loads(raw)
        # An entry written before the cache existed has none (it expires within minutes).
        cache = (
            (str(v[10][0]), int(v[10][1]), float(v[10][2]), str(v[10][3]))
            if len(v) > 10 and len(v[10]) == 4
            else ("off", 0, 1.0, "")
        )
        return cls(
            v[0],
            v[1],
            v[2],
            v[3],
            v[4],
            v[5],
            frozenset(v[6]),
            v[7],
            tuple(v[8]),
            tuple(v[9]),
            cache,
            # An entry written before priority classes existed has none (expires in minutes).
            str(v[11]) if len(v) > 11 else DEFAULT_CLASS,
        )


def _limits(obj: LimitFields) -> tuple[int, ...]:
    return tuple(getattr(obj, name) or 0 for name in LimitFields.LIMIT_NAMES)


def key_info_from_db(prefix: str) -> KeyInfo | None:
    """A key as the gateway knows it, from Postgres: None if revoked or of a suspended
    tenant (a batch worker runs its lines with it)."""
    key = (
        ApiKey.objects.select_related("tenant")
        .filter(prefix=prefix, revoked_at__isnull=True, tenant__status=Tenant.Status.ACTIVE)
        .first()
    )
    if key is None:
        return None
    return KeyInfo(
        key_id=key.pk,
        prefix=key.prefix,
        digest=key.secret_hash,
        tenant_id=key.tenant_id,
        tenant_slug=key.tenant.slug,
        weight=key.tenant.weight,
        scopes=frozenset(key.scopes),
        expires_at=key.expires_at.timestamp() if key.expires_at else None,
        tenant_limits=_limits(key.tenant),
        key_limits=_limits(key),
        cache=(
            # A key kept out of its tenant's cache bypasses it (``cache.ticket``).
            key.tenant.response_cache
            if key.use_response_cache or key.tenant.response_cache == "off"
            else "key-off",
            key.tenant.response_cache_ttl_seconds,
            key.tenant.response_cache_threshold,
            key.tenant.response_cache_embedding_model,
        ),
        priority=key.effective_priority_class,
    )


_l1: dict[str, tuple[float, KeyInfo | None]] = {}
_loading: dict[str, asyncio.Future[KeyInfo | None]] = {}


async def _load_once(prefix: str) -> KeyInfo | None:
    """One look-up per key at a time: a burst of requests on a cold key waits for the first."""
    pending = _loading.get(prefix)
    if pending is not None:
        return await asyncio.shield(pending)
    future: asyncio.Future[KeyInfo | None] = asyncio.get_running_loop().create_future()
    _loading[prefix] = future
    try:
        info = await _load(prefix)
    except BaseException as exc:
        future.set_exception(exc)
        future.exception()  # retrieved: waiters get it; nobody else needs to
        raise
    finally:
        _loading.pop(prefix, None)
    future.set_result(info)
    return info


async def _load(prefix: str) -> KeyInfo | None:
    client = redis_async()
    entry_key = KEY_ENTRY.format(prefix=prefix)
    raw = await client.get(entry_key)
    if raw == UNKNOWN:
        return None
    if isinstance(raw, bytes) and raw != TOMBSTONE:
        return KeyInfo.from_json(raw)
    info = await run_db(key_info_from_db, prefix)
    if raw is None:  # never over a tombstone: a change just happened
        pipe = client.pipeline(transaction=False)
        if info is None:
            pipe.set(entry_key, UNKNOWN, ex=UNKNOWN_SECONDS, nx=True)
        else:
            pipe.set(entry_key, info.to_json(), ex=ENTRY_SECONDS, nx=True)
            pipe.sadd(TENANT_KEYS.format(tenant_id=info.tenant_id), prefix)
        await pipe.execute()
    return info


def bearer_token(authorization: bytes | None) -> str:
    if not authorization:
        raise ApiError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-ip-…'.",
            code="invalid_api_key",
        )
    scheme, _, token = authorization.decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401, "Send the API key as 'Authorization: Bearer sk-ip-…'.", code="invalid_api_key"
        )
    return token.strip()


async def authenticate(raw_key: str, *, scope: str = ApiKey.Scope.INFERENCE) -> KeyInfo:
    parsed = key_parse(raw_key)
    if parsed is None:
        raise invalid_api_key(raw_key)
    now = time.monotonic()
    hit = _l1.get(parsed.prefix)
    if hit is not None and hit[0] > now:
        info = hit[1]
    else:
        info = await _load_once(parsed.prefix)
        if len(_l1) >= L1_MAX_ENTRIES:
            _l1.clear()
        _l1[parsed.prefix] = (now + L1_SECONDS, info)
    if info is None or not digest_matches(info.digest, parsed.digest):
        raise invalid_api_key(raw_key)
    if info.expires_at is not None and info.expires_at <= time.time():
        raise invalid_api_key(raw_key)
    if scope not in info.scopes:
        raise ApiError(
            403,
            f"This API key does not have the '{scope}' scope.",
            type="permission_error",
            code="insufficient_scope",
        )
    return info
