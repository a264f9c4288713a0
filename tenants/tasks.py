import logging

from celery import shared_task

from tenants.services import api_keys_last_used_flush as flush

logger = logging.getLogger(__name__)

# Between tries of a validation that failed on storage or the database: 10 s, 20 s, 40 s...
RETRY_BASE_SECONDS = 10


@shared_task(ignore_result=True)
def api_keys_last_used_flush() -> int:
    return flush()
