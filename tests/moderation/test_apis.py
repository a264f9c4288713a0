"""The moderation control API and command as tenant members, operators and outsiders use
them: who may read and change the policy, what a policy that cannot work gets back, and that
events are only ever a tenant's own."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.urls import reverse

from controlplane.redis import redis_sync
from moderation.models import ModerationEvent, ModerationPolicy
from moderation.policy import snapshot_decoder
from moderation.publishing import POLICIES_KEY
from moderation.services import moderation_policy_set
from tenants.models import AuditEvent
from tests.conftest import TenantPeople, client_for, run_manage

PERSONAS = ["owner", "admin", "developer", "finance", "viewer", "outsider", "staff"]

MATRIX: list[tuple[str, str, dict[str, Any], list[int]]] = [
    ("get", "moderation:policy", {}, [200, 200, 200, 200, 200, 404, 200]),
    (
        "post",
        "moderation:policy-update",
        {"deny_terms": ["secret"]},
        [200, 200, 403, 403, 403, 404, 200],
    ),
    ("get", "moderation:events", {}, [200, 200, 403, 403, 403, 404, 200]),
]


@pytest.mark.parametrize(("method", "name", "body", "expected"), MATRIX)
def test_who_may_do_what(
    people: TenantPeople, method: str, name: str, body: dict[str, Any], expected: list[int]
) -> None:
    url = reverse(name, kwargs={"slug": people.tenant.slug})
    for persona, status in zip(PERSONAS, expected, strict=True):
        client = client_for(people.user(persona))
        response = getattr(client, method)(url, body, format="json")
        assert response.status_code == status, (persona, response.content)


def test_a_policy_is_saved_published_and_audited(
    people: TenantPeople, django_capture_on_commit_callbacks: Any
) -> None:
    client = client_for(people.owner)
    url = reverse("moderation:policy", kwargs={"slug": "acme"})
    assert client.get(url).json() == {"enabled": False, "configured": False}
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            reverse("moderation:policy-update", kwargs={"slug": "acme"}),
            {"deny_terms": ["Secret", "secret", "plans"], "output_mode": "hold"},
            format="json",
        )
    assert response.status_code == 200, response.content
    policy = response.json()
    assert policy["deny_terms"] == ["Secret", "secret", "plans"]
    assert policy["output_mode"] == "hold" and policy["window_tokens"] == 64
    assert len(policy["categories"]) == 13  # every category on, at the default threshold
    published = snapshot_decoder.decode(redis_sync().get(POLICIES_KEY))  # type: ignore[arg-type]
    assert published[people.tenant.pk].deny_terms == ["Secret", "secret", "plans"]
    assert AuditEvent.objects.filter(action="moderation.policy_created").count() == 1


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"regexes": ["(?<=secret)plan"]}, "regexes", "not a valid pattern"),
        ({"regexes": ["(unclosed"]}, "regexes", "not a valid pattern"),
        ({"categories": {"violence": {"threshold": 2, "action": "block"}}}, "categories", ""),
        ({"categories": {"gossip": {"threshold": 0.5, "action": "block"}}}, "categories", "gossip"),
        ({"window_tokens": 16, "overlap_tokens": 16}, "overlap_tokens", "overlap"),
        ({"output_mode": "later"}, "output_mode", ""),
        ({"deny_terms": [" "]}, "deny_terms", ""),
    ],
)
def test_a_policy_that_cannot_work_gets_drfs_400_with_the_reason(
    people: TenantPeople, body: dict[str, Any], field: str, says: str
) -> None:
    response = client_for(people.owner).post(
        reverse("moderation:policy-update", kwargs={"slug": "acme"}), body, format="json"
    )
    assert response.status_code == 400, response.content
    errors = response.json()
    assert field in errors and says in str(errors[field])
    assert "b'" not in str(errors[field])  # RE2's reason as text, not Python's bytes
    assert not ModerationPolicy.objects.exists()  # nothing half-saved


def test_events_are_only_the_tenants_own(people: TenantPeople) -> None:
    now = datetime.now(UTC)
    for tenant, rid in ((people.tenant, "ours"), (people.other_tenant, "theirs")):
        ModerationEvent.objects.create(
            event_id=rid,
            tenant=tenant,
            request_id=rid,
            where="output",
            action="block",
            categories=[],
            rules=["deny_term"],
            created_at=now,
        )
    owner = client_for(people.owner)
    listed = owner.get(reverse("moderation:events", kwargs={"slug": "acme"})).json()
    assert [e["request_id"] for e in listed["results"]] == ["ours"]
    filtered = owner.get(reverse("moderation:events", kwargs={"slug": "acme"}), {"where": "input"})
    assert filtered.json()["count"] == 0
    bad = owner.get(reverse("moderation:events", kwargs={"slug": "acme"}), {"where": "nowhere"})
    assert bad.status_code == 400 and "where" in bad.json()


@pytest.mark.django_db(transaction=True)
def test_the_command_sets_the_policy_and_refuses_bad_input_in_one_line(
    people: TenantPeople,
) -> None:
    done = run_manage(
        "moderation_policy", "acme", "--action", "flag", "--deny-term", "alpha", "beta",
        "--output-mode", "hold", "--window", "32",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "moderation of acme: on, action flag, 2 deny terms" in done.stdout
    policy = ModerationPolicy.objects.get(tenant=people.tenant)
    assert (policy.window_tokens, policy.overlap_tokens, policy.output_mode) == (32, 8, "hold")
    assert {rule["action"] for rule in policy.categories.values()} == {"flag"}
    off = run_manage("moderation_policy", "acme", "--off")
    assert off.returncode == 0 and "moderation of acme: off" in off.stdout
    for args, says in [
        (("nobody",), "no tenant with slug 'nobody'"),
        (("acme", "--action", "shout"), "--action must be one of block, flag, log"),
        (("acme", "--regex", "(?<=x)y"), "regexes: '(?<=x)y' is not a valid pattern"),
        (("acme", "--window", "many"), "--window must be a whole number"),
    ]:
        failed = run_manage("moderation_policy", *args)
        assert failed.returncode != 0
        assert says in failed.stderr and "Traceback" not in failed.stderr
        assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr


def test_a_policy_change_by_the_service_keeps_what_was_not_sent(people: TenantPeople) -> None:
    moderation_policy_set(tenant=people.tenant, changes={"deny_terms": ["x"]}, actor=None)
    policy = moderation_policy_set(tenant=people.tenant, changes={"fail_open": False}, actor=None)
    assert policy.deny_terms == ["x"] and policy.fail_open is False
