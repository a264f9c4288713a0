"""The gateways' moderation events (a Redis stream) into Postgres, through the drains
process's consumer (``ModerationEventsDrain``): what comes is stored, and so is what a Redis
that restarted with its clock behind gives ids below the last one the drain saw."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from controlplane.redis import redis_sync
from moderation.models import ModerationEvent
from moderation.services import EVENTS_STREAM, ModerationEventsDrain
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_drain_stores_what_comes_and_what_a_restart_left_below_it() -> None:
    tenant = TenantFactory.create()
    client = redis_sync()

    def event(request_id: str) -> Any:
        data = {
            "tenant_id": tenant.pk,
            "request_id": request_id,
            "where": "input",
            "action": "flag",
            "at": time.time(),
        }
        return {"e": orjson.dumps(data)}

    drain = ModerationEventsDrain()
    assert drain.step(0.05) == 0
    client.xadd(EVENTS_STREAM, event("before"), id="2000000000000-0")
    assert drain.step(0.05) == 1
    assert client.xlen(EVENTS_STREAM) == 0  # stored, then deleted
    # Redis restarted empty, its clock far behind: the next event's id is below the last seen.
    client.delete(EVENTS_STREAM)
    client.xadd(EVENTS_STREAM, event("after"), id="1000-0")
    stored = [drain.step(0.05) for _ in range(ModerationEventsDrain.LOOK_EVERY + 1)]
    assert sum(stored) == 1
    assert sorted(
        ModerationEvent.objects.filter(tenant=tenant).values_list("request_id", flat=True)
    ) == ["after", "before"]
