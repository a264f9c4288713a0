from celery import shared_task

from inference.catalog import catalog_publish
from inference.selectors import replica_list
from inference.services import replica_probe


@shared_task
def replicas_probe_all() -> None:
    """Probe every replica, then publish the catalog (which also heals a flushed Redis)."""
    for replica in replica_list():
        replica_probe(replica=replica)
    catalog_publish()
