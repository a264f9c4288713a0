from celery import shared_task

from inference.selectors import replica_list
from inference.services import replica_probe


@shared_task
def replicas_probe_all() -> None:
    for replica in replica_list():
        replica_probe(replica=replica)
