"""What the gateway caches about API keys, and its invalidation.

The gateway looks a key up in a 1-second in-process cache, then in Redis
(``ip:key:<prefix>``, five minutes; a prefix Postgres does not know, 30 seconds), then in
Postgres. A change to a key or its tenant
replaces the Redis entry with a short-lived tombstone after the database commit: loaders
write with SET NX, so one that read the database just before the change cannot put the
old entry back. The invalidation is recorded in the same transaction as the change (an
outbox) and retried until Redis takes it. The in-process entry lives at most one more
second, so a revoked key stops working everywhere within a second.
"""

from __future__ import annotations

import logging
import threading

import redis
from django.db import transaction

from controlplane.redis import redis_sync
from inference.models import KeyCacheInvalidation
from tenants.models import ApiKey

log = logging.getLogger(__name__)

KEY_ENTRY = "ip:key:{prefix}"
TENANT_KEYS = "ip:tenant:{tenant_id}:keys"
TOMBSTONE = b"-"
TOMBSTONE_SECONDS = 10
ENTRY_SECONDS = 300
# A prefix the database does not know (or knows revoked, or of a suspended tenant): remembered
# briefly, so that guessing keys costs the database one query per prefix per half-minute.
UNKNOWN = b"?"
UNKNOWN_SECONDS = 30
# How often the drains process looks for invalidations Redis could not take (a database
# query, nothing asked of Redis while the outbox is empty).
OUTBOX_EVERY = 2.0


def keycache_invalidate(*, prefix: str = "", tenant_id: int | None = None) -> None:
    """Make the gateways forget a key (by prefix) or every key of a tenant, once the current
    transaction commits. Recorded in the outbox with the change itself, so an invalidation
    that Redis cannot take right then is retried (every ``OUTBOX_EVERY`` seconds, by the
    drains process) until it holds: a revoked key or a suspended tenant can never go on
    working by accident."""
    KeyCacheInvalidation.objects.create(prefix=prefix, tenant_id=tenant_id)
    transaction.on_commit(keycache_outbox_flush)


def keycache_outbox_flush(*, batch: int = 500) -> int:
    """Apply pending invalidations to Redis; those applied leave the outbox. Safe anywhere,
    any number at once (rows are claimed with SKIP LOCKED). A Redis error leaves them for
    the next run."""

    done = 0
    while True:
        with transaction.atomic():
            pending = list(KeyCacheInvalidation.objects.select_for_update(skip_locked=True)[:batch])
            if not pending:
                return done
            prefixes = {p.prefix for p in pending if p.prefix}
            tenants = {p.tenant_id for p in pending if p.tenant_id is not None}
            # Every key of a tenant, not only those cached: one remembered as unknown while
            # the tenant was suspended must work as soon as it is resumed.
            prefixes |= set(
                ApiKey.objects.filter(tenant_id__in=tenants).values_list("prefix", flat=True)
            )
            try:
                client = redis_sync()
                for tenant_id in tenants:
                    members = client.smembers(TENANT_KEYS.format(tenant_id=tenant_id))
                    prefixes |= {m.decode() for m in members}  # type: ignore[union-attr]
                pipe = client.pipeline(transaction=False)
                for prefix in prefixes:
                    pipe.set(KEY_ENTRY.format(prefix=prefix), TOMBSTONE, ex=TOMBSTONE_SECONDS)
                for tenant_id in tenants:
                    pipe.delete(TENANT_KEYS.format(tenant_id=tenant_id))
                pipe.execute()
            except redis.RedisError:
                log.warning("key cache invalidation deferred: Redis unavailable", exc_info=True)
                return done
            KeyCacheInvalidation.objects.filter(pk__in=[p.pk for p in pending]).delete()
            done += len(pending)


class KeyCacheOutboxDrain:
    """The outbox's retrier in the drains process (``controlplane.drains``). The outbox only
    fills while Redis refuses writes, so it is looked at in the database, not waited on."""

    name = "key-cache-outbox"

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.stop = stop or threading.Event()  # its wait ends with the drains process

    def reset(self) -> None:
        pass

    def step(self, block_seconds: float) -> int:
        if self.stop.wait(min(block_seconds, OUTBOX_EVERY)):
            return 0
        if not KeyCacheInvalidation.objects.exists():
            return 0
        return keycache_outbox_flush()
