"""Stored responses (the Responses API's state): reached only with their tenant, gone when
deleted or past their retention, and purged from the database then."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from conversations.models import StoredResponse
from conversations.selectors import stored_response_get
from conversations.services import (
    stored_response_create,
    stored_response_delete,
    stored_responses_purge,
)
from conversations.tasks import stored_responses_purge_task
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db


def _store(tenant_id: int, response_id: str, *, days_ago: int = 0) -> StoredResponse:
    return stored_response_create(
        response_id=response_id,
        tenant_id=tenant_id,
        api_key_id=None,
        request_id="r",
        model="m",
        body={"id": response_id},
        input_items=[],
        conversation=[{"role": "user", "content": "hi"}],
        created_at=timezone.now() - timedelta(days=days_ago),
    )


def test_a_stored_response_is_its_tenant_s_alone() -> None:
    mine, theirs = TenantFactory.create(), TenantFactory.create()
    _store(mine.id, "resp_a")
    assert stored_response_get(tenant_id=mine.id, response_id="resp_a").conversation
    with pytest.raises(StoredResponse.DoesNotExist):
        stored_response_get(tenant_id=theirs.id, response_id="resp_a")
    assert not stored_response_delete(tenant_id=theirs.id, response_id="resp_a")
    assert stored_response_delete(tenant_id=mine.id, response_id="resp_a")
    assert not StoredResponse.objects.exists()


@override_settings(INFERPLANE_RESPONSES_RETENTION_DAYS=7)
def test_past_its_retention_a_response_is_gone_and_then_purged() -> None:
    tenant = TenantFactory.create()
    _store(tenant.id, "resp_old", days_ago=8)
    _store(tenant.id, "resp_new", days_ago=6)
    with pytest.raises(StoredResponse.DoesNotExist):
        stored_response_get(tenant_id=tenant.id, response_id="resp_old")
    assert not stored_response_delete(tenant_id=tenant.id, response_id="resp_old")
    assert stored_response_get(tenant_id=tenant.id, response_id="resp_new")
    assert stored_responses_purge_task() == 1
    assert list(StoredResponse.objects.values_list("id", flat=True)) == ["resp_new"]
    assert stored_responses_purge() == 0
