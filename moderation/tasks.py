from celery import shared_task

from moderation.publishing import policies_publish


@shared_task(ignore_result=True)
def moderation_policies_publish_task() -> None:
    policies_publish()
