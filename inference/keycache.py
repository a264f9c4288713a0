"""What the gateway caches about API keys, and its invalidation.

The gateway looks a key up in a 1-second in-process cache, then in Redis
(``ip:key:<prefix>``, five minutes), then in Postgres. A change to a key or its tenant
replaces the Redis entry with a short-lived tombstone after the database commit: loaders
write with SET NX, so one that read the database just before the change cannot put the
old entry back. The in-process entry lives at most one more second, so a revoked key stops
working everywhere within a second.
"""

from __future__ import annotations

import logging

import redis

from controlplane.redis import redis_sync

log = logging.getLogger(__name__)

KEY_ENTRY = "ip:key:{prefix}"
TENANT_KEYS = "ip:tenant:{tenant_id}:keys"
TOMBSTONE = b"-"
TOMBSTONE_SECONDS = 10
ENTRY_SECONDS = 300


def key_invalidate_publish(*, prefix: str) -> None:
    try:
        redis_sync().set(KEY_ENTRY.format(prefix=prefix), TOMBSTONE, ex=TOMBSTONE_SECONDS)
    except redis.RedisError:
        # The entry then expires on its own TTL; nothing else can be done from here.
        log.warning("could not invalidate cached key %s in Redis", prefix, exc_info=True)


def tenant_invalidate_publish(*, tenant_id: int) -> None:
    client = redis_sync()
    members_key = TENANT_KEYS.format(tenant_id=tenant_id)
    try:
        prefixes = [p.decode() for p in client.smembers(members_key)]  # type: ignore[union-attr]
        pipe = client.pipeline(transaction=False)
        for prefix in prefixes:
            pipe.set(KEY_ENTRY.format(prefix=prefix), TOMBSTONE, ex=TOMBSTONE_SECONDS)
        pipe.delete(members_key)
        pipe.execute()
    except redis.RedisError:
        log.warning("could not invalidate cached keys of tenant %s", tenant_id, exc_info=True)
