"""A tenant's response cache emptied at once (by its admin, or when its key or policy changes)."""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from controlplane.redis import redis_sync
from inference.gateway import cache
from tenants.models import Tenant, User
from tenants.services import audit_record

log = logging.getLogger(__name__)


def response_cache_forget(*, tenant_id: int) -> int:
    """Every answer in the tenant's response cache gone at once; how many there were (0, and
    a warning, when Redis cannot be reached: the answers then expire with their TTL)."""
    try:
        return int(redis_sync().eval(cache.PURGE.source, 1, cache.prefix(tenant_id)))
    except RedisError:
        log.warning("could not empty the response cache of tenant %s", tenant_id, exc_info=True)
        return 0


def response_cache_purge(*, tenant: Tenant, actor: User | None) -> int:
    """Every answer in the tenant's response cache gone at once; how many there were. Raises
    RedisError when Redis cannot be reached (nothing purged)."""
    purged = int(redis_sync().eval(cache.PURGE.source, 1, cache.prefix(tenant.pk)))
    audit_record(
        actor=actor, tenant=tenant, action="cache.purge", target=tenant, details={"purged": purged}
    )
    return purged
