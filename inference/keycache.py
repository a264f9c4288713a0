"""Invalidation of what the gateway caches about API keys.

The gateway (serving issue) looks a key up in a 1-second in-process cache, then in Redis
(``ip:key:<prefix>``, a short TTL), then in Postgres. Changing a key or its tenant deletes the
Redis entries here, after the database commit; the in-process entry then lives at most one
more second, so a revoked key stops working everywhere within a second.
"""

from __future__ import annotations

import logging

import redis

from controlplane.redis import redis_sync

log = logging.getLogger(__name__)

KEY_ENTRY = "ip:key:{prefix}"
TENANT_KEYS = "ip:tenant:{tenant_id}:keys"


def key_invalidate_publish(*, prefix: str) -> None:
    try:
        redis_sync().delete(KEY_ENTRY.format(prefix=prefix))
    except redis.RedisError:
        # The Redis entry then expires on its own TTL; nothing else can be done from here.
        log.warning("could not invalidate cached key %s in Redis", prefix, exc_info=True)


def tenant_invalidate_publish(*, tenant_id: int) -> None:
    client = redis_sync()
    members_key = TENANT_KEYS.format(tenant_id=tenant_id)
    try:
        prefixes = [p.decode() for p in client.smembers(members_key)]  # type: ignore[union-attr]
        pipe = client.pipeline(transaction=False)
        for prefix in prefixes:
            pipe.delete(KEY_ENTRY.format(prefix=prefix))
        pipe.delete(members_key)
        pipe.execute()
    except redis.RedisError:
        log.warning("could not invalidate cached keys of tenant %s", tenant_id, exc_info=True)
