from celery import shared_task

from moderation.publishing import policies_publish
from moderation.services import moderation_events_flush


@shared_task(ignore_result=True)
def moderation_events_flush_task() -> int:
    return moderation_events_flush()


@shared_task(ignore_result=True)
def moderation_policies_publish_task() -> None:
    policies_publish()
