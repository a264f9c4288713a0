import logging
from typing import Any

from celery import shared_task
from django.db import DatabaseError
from redis.exceptions import RedisError

from fleet.models import Pool
from inference.catalog import catalog_publish
from inference.selectors import pool_list, replica_list
from inference.services import ProbeRound, adapter_retire, pool_discovery_sync, replica_probe

log = logging.getLogger(__name__)


@shared_task
def replicas_probe_all() -> None:
    """Resolve the DNS pools' names (new addresses become replicas, vanished ones drain and
    go), probe every replica, then publish the catalog (which also heals a flushed Redis)."""
    for pool in pool_list().filter(discovery=Pool.Discovery.DNS):
        try:
            pool_discovery_sync(pool=pool)
        except Exception:  # one pool's trouble must not stop the others' probes
            log.exception("discovery of pool %s failed", pool.name)
    # Replicas whose address vanished are leaving: nothing to learn from probing them.
    round_ = ProbeRound.begin()
    try:
        for replica in replica_list().filter(vanished_at__isnull=True):
            replica_probe(replica=replica, round_=round_)
    finally:
        round_.end()
    catalog_publish()


@shared_task(
    bind=True,
    ignore_result=True,
    max_retries=120,
    default_retry_delay=30,
    autoretry_for=(RedisError, DatabaseError),
)
def adapter_retire_task(self: Any, adapter_id: int) -> None:
    """Unload a deleted adapter everywhere; its files go once no request runs with it or
    waits for it (checked every 30 s, for up to an hour; then they go regardless)."""
    last_try = self.request.retries >= self.max_retries
    if not adapter_retire(adapter_id=adapter_id, force=last_try):
        raise self.retry()
