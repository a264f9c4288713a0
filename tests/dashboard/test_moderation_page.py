"""The dashboard's Moderation page: members see the policy, owners and admins change it,
a regex RE2 refuses comes back as a form error (nothing saved), events are the tenant's own
and shown to those who read the audit log, outsiders get 404."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.test import Client

from moderation.models import ModerationEvent, ModerationPolicy
from tenants.models import User
from tests.conftest import TenantPeople

pytestmark = pytest.mark.django_db

URL = "/app/t/acme/moderation/"
FORM = {
    "enabled": "on",
    "check_input": "on",
    "check_output": "on",
    "action": "block",
    "threshold": "0.7",
    "deny_terms": "alpha\nbeta\n\n",
    "regexes": r"order-\d{4}",
    "pii_action": "mask",
    "classifier": "on",
    "guard_model": "",
    "output_mode": "hold",
    "window_tokens": "32",
    "overlap_tokens": "8",
    "fail_open": "on",
    "budget_ms": "200",
}


def browser(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_members_see_it_admins_change_it_outsiders_get_404(people: TenantPeople) -> None:
    viewer = browser(people.viewer)
    page = viewer.get(URL).content.decode()
    assert "no moderation policy" in page and 'id="moderation-form"' not in page
    assert viewer.post(URL, FORM).status_code == 403
    assert browser(people.developer).post(URL, FORM).status_code == 403
    assert browser(people.outsider).get(URL).status_code == 404
    assert browser(people.outsider).post(URL, FORM).status_code == 404
    assert not ModerationPolicy.objects.exists()

    admin = browser(people.admin)
    assert 'id="moderation-form"' in admin.get(URL).content.decode()
    assert admin.post(URL, FORM).status_code == 302
    policy = ModerationPolicy.objects.get(tenant=people.tenant)
    assert policy.deny_terms == ["alpha", "beta"] and policy.regexes == [r"order-\d{4}"]
    assert (policy.output_mode, policy.window_tokens, policy.pii_action) == ("hold", 32, "mask")
    assert {r["threshold"] for r in policy.categories.values()} == {0.7}
    assert len(policy.categories) == 13
    shown = viewer.get(URL).content.decode()
    assert "answers checked in <strong>hold</strong> mode" in shown and "2 deny terms" in shown


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"regexes": "(?<=secret)plan"}, "is not a valid pattern"),
        ({"window_tokens": "16", "overlap_tokens": "13"}, "the overlap is 0 to 12 tokens"),
        ({"guard_model": "nothing-here"}, "no classification model named"),
        ({"threshold": "3"}, "less than or equal to 1"),
    ],
)
def test_a_policy_that_cannot_work_is_a_form_error(
    people: TenantPeople, change: dict[str, str], says: str
) -> None:
    response = browser(people.owner).post(URL, FORM | change)
    assert response.status_code == 400
    assert says in response.content.decode()
    assert not ModerationPolicy.objects.exists()


def test_events_are_shown_to_audit_readers_only_and_only_the_tenants_own(
    people: TenantPeople,
) -> None:
    now = datetime.now(UTC)
    for tenant, rid in ((people.tenant, "req-ours"), (people.other_tenant, "req-theirs")):
        ModerationEvent.objects.create(
            event_id=rid, tenant=tenant, request_id=rid, where="input", action="block",
            categories=["violence"], rules=[], created_at=now,
        )  # fmt: skip
    page = browser(people.owner).get(URL).content.decode()
    assert "req-ours" in page and "req-theirs" not in page and "violence" in page
    assert "req-ours" not in browser(people.viewer).get(URL).content.decode()
