from celery import shared_task

from tenants.services import adapter_validate
from tenants.services import api_keys_last_used_flush as flush


@shared_task(ignore_result=True)
def api_keys_last_used_flush() -> int:
    return flush()


@shared_task(ignore_result=True)
def adapter_validate_task(adapter_id: int) -> None:
    adapter_validate(adapter_id=adapter_id)
