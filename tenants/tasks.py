from celery import shared_task

from tenants.services import api_keys_last_used_flush as flush


@shared_task(ignore_result=True)
def api_keys_last_used_flush() -> int:
    return flush()
