"""Reads. A stored response is reached only with its tenant; an expired one is gone."""

from __future__ import annotations

from django.utils import timezone

from conversations.models import StoredResponse


def stored_response_get(*, tenant_id: int, response_id: str) -> StoredResponse:
    """Raises ``StoredResponse.DoesNotExist`` for an id that is not this tenant's (or is
    past its retention): the two cannot be told apart."""
    return StoredResponse.objects.get(
        tenant_id=tenant_id, id=response_id, expires_at__gt=timezone.now()
    )
