from celery import shared_task

from billing.services import usage_spool_flush


@shared_task(ignore_result=True)
def usage_spool_flush_task() -> int:
    return usage_spool_flush()
