from typing import Any

from celery import shared_task
from django.db import DatabaseError
from redis.exceptions import RedisError

from inference.catalog import catalog_publish
from inference.selectors import replica_list
from inference.services import adapter_retire, replica_probe


@shared_task
def replicas_probe_all() -> None:
    """Probe every replica, then publish the catalog (which also heals a flushed Redis)."""
    for replica in replica_list():
        replica_probe(replica=replica)
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
