"""The gateway's "80% of a monthly budget used" notices (a Redis list) into the audit log,
through the drains process's consumer (``BudgetWarningsDrain``)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import OperationalError, connection

from billing.budget_warnings import BUDGET_WARNINGS
from billing.services import BudgetWarningsDrain
from controlplane.redis import redis_sync
from tenants.models import AuditEvent
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _notice(tenant_id: int, used: int = 80, limit: int = 100) -> str:
    return f"tokens|t|{tenant_id}|202612|{used}|{limit}"


def test_a_notice_becomes_one_audit_event_and_a_repeat_none() -> None:
    tenant = TenantFactory.create()
    drain = BudgetWarningsDrain()
    assert drain.step(0.05) == 0  # nothing noted: the wait ends empty
    redis_sync().rpush(BUDGET_WARNINGS, _notice(tenant.pk), _notice(tenant.pk, used=85))
    assert drain.step(0.05) == 1
    (event,) = AuditEvent.objects.filter(tenant=tenant, action="budget.warning")
    assert event.details == {
        "kind": "tokens",
        "month": "2026-12",
        "used": 80,
        "limit": 100,
        "percent": 80.0,
    }


def test_notices_the_database_cannot_take_wait_in_redis_in_their_order(
    serving_db_url: str,
) -> None:
    """The database refuses (the tenants' table locked past a statement timeout): the
    notices taken off the list go back to its head, in order, and the next step after the
    outage writes them."""
    first, second = TenantFactory.create(), TenantFactory.create()
    notes = [_notice(first.pk), _notice(second.pk)]
    redis_sync().rpush(BUDGET_WARNINGS, *notes)
    drain = BudgetWarningsDrain()
    with psycopg.connect(serving_db_url) as locker:
        locker.execute("LOCK TABLE tenants_tenant IN ACCESS EXCLUSIVE MODE")
        with connection.cursor() as cursor:
            cursor.execute("SET statement_timeout = 300")
        with pytest.raises(OperationalError):
            drain.step(0.05)
        held: Any = redis_sync().lrange(BUDGET_WARNINGS, 0, -1)
        assert [n.decode() for n in held] == notes
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = 0")
    assert drain.step(0.05) == 2
    assert redis_sync().llen(BUDGET_WARNINGS) == 0
    targets: Any = AuditEvent.objects.filter(action="budget.warning").values_list(
        "target_id", flat=True
    )
    assert sorted(targets) == sorted([str(first.pk), str(second.pk)])
