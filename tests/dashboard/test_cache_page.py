"""The dashboard's Cache page: members see whether the tenant's response cache is on and how
much it answered this month; owners and admins turn it on or off, set its TTL and purge it
(Redis emptied of the tenant's answers, nobody else's); a bad TTL is a form error; outsiders
get 404."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.test import Client

from billing.models import DailyUsage
from controlplane.redis import redis_sync
from inference.gateway import cache
from tenants.models import AuditEvent, Tenant, User
from tests.conftest import TenantPeople

pytestmark = pytest.mark.django_db

URL = "/app/t/acme/cache/"
PURGE = "/app/t/acme/cache/purge/"
FORM = {"mode": "exact", "ttl_seconds": "600", "threshold": "0.95", "embedding_model": ""}


def browser(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _hold(tenant: Tenant, digest: str) -> None:
    """An answer in the tenant's cache, as the gateway stores it."""
    client = redis_sync()
    client.eval(cache.STORE.source, 1, cache.prefix(tenant.pk), digest, "{}", 60_000, 10, 10_000)


def test_members_see_it_admins_change_and_purge_it_outsiders_get_404(
    people: TenantPeople,
) -> None:
    today = datetime.now(UTC).date()
    DailyUsage.objects.create(
        day=today, tenant=people.tenant, model="m", mode="online", requests=10, cache_hits=4
    )
    viewer = browser(people.viewer)
    page = viewer.get(URL).content.decode()
    assert "Off: every request goes to the engines" in page
    assert "4 of 10 requests answered from the cache" in page
    assert 'id="cache-form"' not in page and 'id="cache-purge"' not in page
    assert viewer.post(URL, FORM).status_code == 403
    assert browser(people.developer).post(PURGE).status_code == 403
    assert browser(people.outsider).get(URL).status_code == 404
    assert browser(people.outsider).post(PURGE).status_code == 404

    admin = browser(people.admin)
    assert admin.post(URL, {**FORM, "ttl_seconds": "5"}).status_code == 400
    refused = admin.post(URL, {**FORM, "mode": "semantic"})  # with no model to embed with
    assert refused.status_code == 400 and "needs an embedding model" in refused.content.decode()
    assert admin.post(URL, FORM).status_code == 302
    people.tenant.refresh_from_db()
    assert (people.tenant.response_cache, people.tenant.response_cache_ttl_seconds) == (
        "exact",
        600,
    )
    assert "On (exact)" in admin.get(URL).content.decode()

    _hold(people.tenant, "a")
    _hold(people.tenant, "b")
    _hold(people.other_tenant, "a")
    purged = admin.post(PURGE)
    assert purged.status_code == 302 and purged["location"].endswith("?purged=2")
    assert "Purged: 2 answers" in admin.get(purged["location"]).content.decode()
    client = redis_sync()
    assert client.keys(cache.prefix(people.tenant.pk) + "*") == []
    assert client.get(cache.prefix(people.other_tenant.pk) + "e:a") == b"{}"  # not theirs
    actions = set(AuditEvent.objects.filter(tenant=people.tenant).values_list("action", flat=True))
    assert {"tenant.cache", "cache.purge"} <= actions
    client.eval(cache.PURGE.source, 1, cache.prefix(people.other_tenant.pk))
