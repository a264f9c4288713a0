"""Writes: a response stored, deleted, and the ones past their retention purged."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from conversations.models import StoredResponse


def stored_response_create(
    *,
    response_id: str,
    tenant_id: int,
    api_key_id: int | None,
    request_id: str,
    model: str,
    body: dict[str, Any],
    input_items: list[dict[str, Any]],
    conversation: list[dict[str, Any]],
    created_at: datetime,
) -> StoredResponse:
    """Kept for ``INFERPLANE_RESPONSES_RETENTION_DAYS`` from its creation."""
    return StoredResponse.objects.create(
        id=response_id,
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        request_id=request_id,
        model=model,
        body=body,
        input_items=input_items,
        conversation=conversation,
        created_at=created_at,
        expires_at=created_at + timedelta(days=settings.INFERPLANE_RESPONSES_RETENTION_DAYS),
    )


def stored_response_delete(*, tenant_id: int, response_id: str) -> bool:
    """Whether the tenant had it (another tenant's id deletes nothing)."""
    deleted, _ = StoredResponse.objects.filter(
        tenant_id=tenant_id, id=response_id, expires_at__gt=timezone.now()
    ).delete()
    return bool(deleted)


def stored_responses_purge(*, batch: int = 5000) -> int:
    """Delete what is past its retention, a batch at a time; how many went."""
    ids = list(
        StoredResponse.objects.filter(expires_at__lte=timezone.now()).values_list("id", flat=True)[
            :batch
        ]
    )
    if not ids:
        return 0
    deleted, _ = StoredResponse.objects.filter(id__in=ids).delete()
    return deleted
