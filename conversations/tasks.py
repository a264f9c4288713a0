from celery import shared_task


@shared_task(ignore_result=True)
def stored_responses_purge_task() -> int:
    """Stored responses past their retention (beat: hourly)."""
    from conversations.services import stored_responses_purge

    total = 0
    while deleted := stored_responses_purge():
        total += deleted
    return total
