import logging
from typing import Any

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.dispatch import receiver

from adapters.models import Adapter
from adapters.services import adapter_reject, adapter_validate, adapters_stuck_reject
from adapters.signals import adapter_uploaded

logger = logging.getLogger(__name__)

# Between tries of a validation that failed on storage or the database: 10 s, 20 s, 40 s...
RETRY_BASE_SECONDS = 10


# Routed to the "adapters" queue (CELERY_TASK_ROUTES), served by its own worker: an upload
# being validated never holds up probes, metering or rollups.
@shared_task(
    bind=True,
    ignore_result=True,
    max_retries=settings.ADAPTER_VALIDATION_RETRIES,
    soft_time_limit=settings.ADAPTER_VALIDATION_SECONDS,
    # The soft limit raises in the task, which then rejects the version; the hard one kills
    # the process if even that hangs (storage that never answers), and the sweep
    # (adapters_stuck_reject_task) gives the verdict later.
    time_limit=settings.ADAPTER_VALIDATION_SECONDS + 30,
)
def adapter_validate_task(self: Any, adapter_id: int) -> None:
    """Ends in a verdict or a bounded retry. Content that cannot be served is rejected by
    the service; anything else (storage unreachable) is retried with backoff, then the
    version is rejected with a reason that says it was not the adapter's fault."""
    try:
        adapter_validate(adapter_id=adapter_id)
    except Adapter.DoesNotExist:
        return  # its tenant was deleted meanwhile
    except SoftTimeLimitExceeded:
        adapter_reject(
            adapter_id=adapter_id,
            reason=f"Validation took too long (over {settings.ADAPTER_VALIDATION_SECONDS} "
            "seconds), so it was stopped.",
        )
    except Exception as exc:
        attempts = self.request.retries + 1
        if self.request.retries < self.max_retries:
            raise self.retry(
                exc=exc, countdown=RETRY_BASE_SECONDS * 2**self.request.retries
            ) from exc
        logger.exception("adapter %s: validation failed %s times", adapter_id, attempts)
        adapter_reject(
            adapter_id=adapter_id,
            reason=f"Validation failed {attempts} times on an internal error "
            f"({type(exc).__name__}: storage or database unavailable), not because of the "
            "adapter; upload it again later.",
        )


@shared_task(ignore_result=True)
def adapters_stuck_reject_task() -> int:
    return adapters_stuck_reject()


@receiver(adapter_uploaded)
def _uploaded(sender: Any, *, adapter_id: int, **_: Any) -> None:
    """An upload committed: its validation is queued."""
    adapter_validate_task.delay(adapter_id)
