"""The control API as tenant members, operators and outsiders use it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import connection
from django.urls import reverse
from rest_framework.test import APIClient

from tenants.models import ApiKey, AuditEvent, Invitation, Membership, Role, Tenant, User
from tenants.selectors import api_key_authenticate
from tenants.services import api_key_create, invitation_create
from tests.conftest import TenantPeople, client_for
from tests.factories import MembershipFactory, UserFactory

PERSONAS = ["owner", "admin", "developer", "finance", "viewer", "outsider", "staff"]


@dataclass
class World:
    """One tenant's objects the endpoints act on."""

    people: TenantPeople
    key: ApiKey  # created by the owner
    extra: Membership  # a developer nobody else depends on
    invitation: Invitation  # an open one, sent by the owner

    def kwargs(self, needs: str) -> dict[str, Any]:
        kw: dict[str, Any] = {"slug": self.people.tenant.slug}
        if needs == "key":
            kw["key_id"] = self.key.pk
        elif needs == "member":
            kw["membership_id"] = self.extra.pk
        elif needs == "invitation":
            kw["invitation_id"] = self.invitation.pk
        return kw


@pytest.fixture
def world(people: TenantPeople) -> World:
    key = api_key_create(tenant=people.tenant, name="prod", created_by=people.owner).api_key
    extra = MembershipFactory.create(tenant=people.tenant, role=Role.DEVELOPER)
    UserFactory.create(username="newbie")
    invitation = invitation_create(
        tenant=people.tenant, role=Role.VIEWER, actor=people.owner, actor_role=Role.OWNER
    ).invitation
    return World(people=people, key=key, extra=extra, invitation=invitation)


# (method, url name, what the URL needs, body, expected status per persona in PERSONAS order)
MATRIX: list[tuple[str, str, str, dict[str, Any], list[int]]] = [
    ("get", "tenant-detail", "", {}, [200, 200, 200, 200, 200, 404, 200]),
    ("post", "tenant-update", "", {"name": "Acme 2"}, [403, 403, 403, 403, 403, 404, 200]),
    ("get", "tenant-limits", "", {}, [200, 200, 200, 200, 200, 404, 200]),
    ("post", "tenant-limits-update", "", {"rpm": 9}, [403, 403, 403, 403, 403, 404, 200]),
    ("get", "tenant-cache", "", {}, [200, 200, 200, 200, 200, 404, 200]),
    ("post", "tenant-cache-update", "", {"mode": "exact"}, [200, 200, 403, 403, 403, 404, 200]),
    ("get", "member-list", "", {}, [200, 200, 200, 200, 200, 404, 200]),
    ("get", "invitation-list", "", {}, [200, 200, 403, 403, 403, 404, 200]),
    ("post", "invitation-create", "", {"role": "viewer"}, [201, 201, 403, 403, 403, 404, 201]),
    ("post", "invitation-revoke", "invitation", {}, [200, 200, 403, 403, 403, 404, 200]),
    ("post", "member-update", "member", {"role": "finance"}, [200, 200, 403, 403, 403, 404, 200]),
    ("post", "member-remove", "member", {}, [204, 204, 403, 403, 403, 404, 204]),
    ("get", "key-list", "", {}, [200, 200, 200, 200, 200, 404, 200]),
    ("get", "key-detail", "key", {}, [200, 200, 200, 200, 200, 404, 200]),
    ("post", "key-create", "", {"name": "ci"}, [201, 201, 201, 403, 403, 404, 201]),
    ("post", "key-revoke", "key", {}, [200, 200, 403, 403, 403, 404, 200]),
    ("post", "key-rotate", "key", {}, [201, 201, 403, 403, 403, 404, 201]),
    ("post", "key-limits-update", "key", {"rpm": 5}, [200, 200, 403, 403, 403, 404, 200]),
    (
        "post",
        "key-priority-update",
        "key",
        {"priority_class": "background"},
        [200, 200, 403, 403, 403, 404, 200],
    ),
    (
        "post",
        "key-cache-update",
        "key",
        {"use_response_cache": False},
        [200, 200, 403, 403, 403, 404, 200],
    ),
    ("get", "audit-list", "", {}, [200, 200, 403, 403, 403, 404, 200]),
]

CASES = [
    pytest.param(method, name, needs, body, persona, expected[i], id=f"{name}-{persona}")
    for method, name, needs, body, expected in MATRIX
    for i, persona in enumerate(PERSONAS)
]


@pytest.mark.parametrize(("method", "name", "needs", "body", "persona", "status"), CASES)
def test_role_matrix(
    world: World,
    method: str,
    name: str,
    needs: str,
    body: dict[str, Any],
    persona: str,
    status: int,
) -> None:
    client = client_for(world.people.user(persona))
    url = reverse(f"tenants:{name}", kwargs=world.kwargs(needs))
    response = getattr(client, method)(url, body, format="json")
    assert response.status_code == status, response.content
    if status == 404:
        # An outsider learns nothing: not the tenant's name, not its objects.
        assert b"acme" not in response.content.lower()


@pytest.mark.parametrize(
    ("method", "name", "needs", "body"),
    [(method, name, needs, body) for method, name, needs, body, _ in MATRIX if needs],
)
def test_outsider_cannot_reach_objects_through_own_tenant(
    world: World, method: str, name: str, needs: str, body: dict[str, Any]
) -> None:
    """IDs of acme's objects under the outsider's own tenant's URL are not found either."""
    kwargs = world.kwargs(needs) | {"slug": world.people.other_tenant.slug}
    response = getattr(client_for(world.people.outsider), method)(
        reverse(f"tenants:{name}", kwargs=kwargs), body, format="json"
    )
    assert response.status_code == 404
    world.key.refresh_from_db()
    assert world.key.revoked_at is None and world.key.rpm is None
    assert Membership.objects.filter(pk=world.extra.pk, role=Role.DEVELOPER).exists()
    world.invitation.refresh_from_db()
    assert world.invitation.is_open


def test_unauthenticated_gets_401(world: World, api: APIClient) -> None:
    response = api.get(reverse("tenants:tenant-list"))
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Token"


def test_tenant_list_shows_only_own_tenants(world: World) -> None:
    def slugs(user: User) -> set[str]:
        answer = client_for(user).get(reverse("tenants:tenant-list")).json()
        return {t["slug"] for t in answer["results"]}

    assert slugs(world.people.viewer) == {"acme"}
    assert slugs(world.people.outsider) == {"globex"}
    assert slugs(world.people.staff) == {"acme", "globex"}


def test_only_staff_create_tenants(world: World) -> None:
    url = reverse("tenants:tenant-create")
    assert client_for(world.people.owner).post(url, {"slug": "new"}).status_code == 403
    response = client_for(world.people.staff).post(
        url, {"slug": "initech", "weight": 3, "tpm": 1000}, format="json"
    )
    assert response.status_code == 201, response.content
    tenant = Tenant.objects.get(slug="initech")
    assert (tenant.weight, tenant.tpm) == (3, 1000)


# --- Keys ---------------------------------------------------------------------------------


def _create_key(client: APIClient, **body: Any) -> dict[str, Any]:
    response = client.post(
        reverse("tenants:key-create", kwargs={"slug": "acme"}), {"name": "k", **body}, format="json"
    )
    assert response.status_code == 201, response.content
    data: dict[str, Any] = response.json()
    return data


def test_key_secret_is_shown_once_and_works(world: World) -> None:
    client = client_for(world.people.developer)
    created = _create_key(client)
    secret = created["key"]
    assert secret.startswith("sk-ip-")
    key = api_key_authenticate(raw_key=secret)
    assert key is not None and key.tenant == world.people.tenant
    detail = client.get(
        reverse("tenants:key-detail", kwargs={"slug": "acme", "key_id": created["id"]})
    ).json()
    listing = client.get(reverse("tenants:key-list", kwargs={"slug": "acme"})).json()
    assert "key" not in detail
    assert secret not in str(listing) and secret not in str(detail)
    assert detail["display_prefix"] == secret[: len("sk-ip-") + 12] + "…"


def test_database_holds_no_key_secret(world: World) -> None:
    """Every row of every table, as text, is searched for the secrets just issued."""
    secrets = [_create_key(client_for(world.people.owner))["key"] for _ in range(3)]
    rotated = client_for(world.people.owner).post(
        reverse("tenants:key-rotate", kwargs={"slug": "acme", "key_id": world.key.pk})
    )
    secrets.append(rotated.json()["key"])
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        tables = [row[0] for row in cursor.fetchall()]
        dump: list[str] = []
        for table in tables:
            cursor.execute(f'SELECT row_to_json(t)::text FROM "{table}" t')  # noqa: S608
            dump.extend(row[0] for row in cursor.fetchall())
    text = "\n".join(dump)
    assert len(dump) > 10 and "api_key.create" in text  # the dump did read the tables
    for secret in secrets:
        assert secret not in text
        assert secret.split("_", 1)[1] not in text


def test_developer_revokes_own_key_but_not_others(world: World) -> None:
    client = client_for(world.people.developer)
    own = _create_key(client)

    def url(key_id: int) -> str:
        return reverse("tenants:key-revoke", kwargs={"slug": "acme", "key_id": key_id})

    assert client.post(url(world.key.pk)).status_code == 403
    response = client.post(url(own["id"]))
    assert response.status_code == 200
    assert response.json()["status"] == "revoked"
    assert api_key_authenticate(raw_key=own["key"]) is None


def test_revoked_and_expired_keys_are_refused(world: World) -> None:
    from datetime import timedelta

    from django.utils import timezone

    client = client_for(world.people.owner)
    revoked = _create_key(client)
    client.post(reverse("tenants:key-revoke", kwargs={"slug": "acme", "key_id": revoked["id"]}))
    soon = timezone.now() + timedelta(minutes=5)
    expiring = _create_key(client, expires_at=soon.isoformat())
    assert api_key_authenticate(raw_key=revoked["key"]) is None
    assert api_key_authenticate(raw_key=expiring["key"]) is not None
    assert api_key_authenticate(raw_key=expiring["key"], now=soon + timedelta(seconds=1)) is None
    # A forged key with a real prefix and a wrong secret is refused too.
    forged = expiring["key"].rsplit("_", 1)[0] + "_" + "x" * 43
    assert api_key_authenticate(raw_key=forged) is None


def test_suspended_tenant_keys_are_refused(world: World) -> None:
    secret = _create_key(client_for(world.people.owner))["key"]
    response = client_for(world.people.staff).post(
        reverse("tenants:tenant-update", kwargs={"slug": "acme"}), {"status": "suspended"}
    )
    assert response.status_code == 200
    assert api_key_authenticate(raw_key=secret) is None


def test_rotation_keeps_old_key_for_the_grace_period(world: World) -> None:
    from datetime import timedelta

    from django.utils import timezone

    old_secret = _create_key(client_for(world.people.owner), rpm=7, scopes=["batch"])
    response = client_for(world.people.admin).post(
        reverse("tenants:key-rotate", kwargs={"slug": "acme", "key_id": old_secret["id"]}),
        {"grace_period_seconds": 3600},
        format="json",
    )
    assert response.status_code == 201, response.content
    new = response.json()
    assert new["name"] == old_secret["name"] and new["scopes"] == ["batch"]
    assert new["limits"]["rpm"] == 7
    later = timezone.now() + timedelta(seconds=3601)
    assert api_key_authenticate(raw_key=old_secret["key"]) is not None
    assert api_key_authenticate(raw_key=old_secret["key"], now=later) is None
    assert api_key_authenticate(raw_key=new["key"], now=later) is not None
    again = client_for(world.people.admin).post(
        reverse("tenants:key-rotate", kwargs={"slug": "acme", "key_id": old_secret["id"]})
    )
    assert again.status_code == 400


def test_effective_limits_are_the_tighter_of_key_and_tenant(world: World) -> None:
    staff = client_for(world.people.staff)
    staff.post(
        reverse("tenants:tenant-limits-update", kwargs={"slug": "acme"}),
        {"rpm": 100, "tpm": 5000, "monthly_spend_budget_usd": "250.50"},
        format="json",
    )
    key = _create_key(client_for(world.people.owner), rpm=500, tpm=1000)
    assert key["effective_limits"]["rpm"] == 100
    assert key["effective_limits"]["tpm"] == 1000
    assert key["effective_limits"]["monthly_spend_budget_usd"] == "250.5"
    world.people.tenant.refresh_from_db()
    assert world.people.tenant.monthly_spend_budget_micros == 250_500_000


def test_developer_cannot_set_limits_when_creating_a_key(world: World) -> None:
    response = client_for(world.people.developer).post(
        reverse("tenants:key-create", kwargs={"slug": "acme"}),
        {"name": "greedy", "rpm": 10},
        format="json",
    )
    assert response.status_code == 403
    assert not ApiKey.objects.filter(name="greedy").exists()


# --- Members --------------------------------------------------------------------------------


def _membership(people: TenantPeople, persona: str) -> Membership:
    return Membership.objects.get(tenant=people.tenant, user=people.user(persona))


def test_last_owner_cannot_be_removed_or_demoted(world: World) -> None:
    people = world.people
    owner = client_for(people.owner)
    own = _membership(people, "owner")
    remove = reverse("tenants:member-remove", kwargs={"slug": "acme", "membership_id": own.pk})
    update = reverse("tenants:member-update", kwargs={"slug": "acme", "membership_id": own.pk})
    response = owner.post(remove)
    assert response.status_code == 400
    assert "last owner" in response.json()["role"][0]
    assert owner.post(update, {"role": "admin"}).status_code == 400
    # With a second owner, the first may step down.
    admin_m = _membership(people, "admin")
    owner.post(
        reverse("tenants:member-update", kwargs={"slug": "acme", "membership_id": admin_m.pk}),
        {"role": "owner"},
    )
    assert owner.post(remove).status_code == 204


def test_admins_cannot_touch_owners(world: World) -> None:
    people = world.people
    admin = client_for(people.admin)
    own = _membership(people, "owner")
    viewer = _membership(people, "viewer")

    def update(m: Membership) -> str:
        return reverse("tenants:member-update", kwargs={"slug": "acme", "membership_id": m.pk})

    assert admin.post(update(viewer), {"role": "owner"}).status_code == 403
    assert admin.post(update(own), {"role": "viewer"}).status_code == 403
    assert (
        admin.post(
            reverse("tenants:member-remove", kwargs={"slug": "acme", "membership_id": own.pk})
        ).status_code
        == 403
    )
    assert _membership(people, "owner").role == Role.OWNER
    assert _membership(people, "viewer").role == Role.VIEWER


def test_any_member_may_leave(world: World) -> None:
    viewer = _membership(world.people, "viewer")
    response = client_for(world.people.viewer).post(
        reverse("tenants:member-remove", kwargs={"slug": "acme", "membership_id": viewer.pk})
    )
    assert response.status_code == 204
    assert not Membership.objects.filter(pk=viewer.pk).exists()


# --- Invitations: the only way in -------------------------------------------------------------


def _invite(client: APIClient, role: str, slug: str = "acme") -> Any:
    return client.post(
        reverse("tenants:invitation-create", kwargs={"slug": slug}), {"role": role}, format="json"
    )


def _pending(client: APIClient) -> list[dict[str, Any]]:
    response = client.get(reverse("tenants:invitation-list", kwargs={"slug": "acme"}))
    assert response.status_code == 200
    return list(response.json()["results"])


def _accept(user: User, token: str) -> Any:
    return client_for(user).post(
        reverse("tenants:invitation-accept"), {"token": token}, format="json"
    )


def test_nobody_is_added_by_username_or_email_and_no_answer_tells_who_exists(
    world: World,
) -> None:
    """The old add-by-name endpoint is gone; the same call for an existing user, their email
    and a made-up name gets the same answer, and nobody becomes a member."""
    owner = client_for(world.people.owner)
    answers = [
        owner.post(
            "/api/tenants/acme/members/create/", {"user": ident, "role": "viewer"}, format="json"
        )
        for ident in ("newbie", "newbie@example.com", "nobody-here", "ghost@example.com")
    ]
    assert {a.status_code for a in answers} == {404}
    assert len({a.content for a in answers}) == 1
    # Inviting names no one: whatever user or email is sent along, the answer has one shape
    # and speaks of no account.
    made = [
        owner.post(
            reverse("tenants:invitation-create", kwargs={"slug": "acme"}),
            {"role": "viewer", "user": ident, "email": ident},
            format="json",
        )
        for ident in ("newbie", "nobody-here@example.com")
    ]
    assert [m.status_code for m in made] == [201, 201]
    assert made[0].json().keys() == made[1].json().keys()
    assert not any("newbie" in m.content.decode() for m in made)
    assert not Membership.objects.filter(user__username="newbie").exists()


def test_an_api_invitation_is_shown_once_and_accepting_it_joins(world: World) -> None:
    owner = client_for(world.people.owner)
    response = _invite(owner, "developer")
    assert response.status_code == 201 and response["Cache-Control"] == "no-store"
    body = response.json()
    token, url = body["token"], body["url"]
    assert url == f"http://testserver/app/join/{token}/"
    assert (body["role"], body["status"], body["created_by"]) == ("developer", "pending", "owner")
    invitation = Invitation.objects.get(pk=body["id"])
    assert token not in invitation.token_hash  # stored hashed
    listed = [i for i in _pending(owner) if i["id"] == body["id"]]
    assert listed and "token" not in listed[0] and "url" not in listed[0]

    newbie = User.objects.get(username="newbie")
    joined = _accept(newbie, token)
    assert joined.status_code == 201, joined.content
    assert joined.json()["role"] == "developer"
    assert Membership.objects.get(tenant=world.people.tenant, user=newbie).role == Role.DEVELOPER
    detail = client_for(newbie).get(reverse("tenants:tenant-detail", kwargs={"slug": "acme"}))
    assert detail.status_code == 200
    assert body["id"] not in [i["id"] for i in _pending(owner)]
    # Once only: nobody else gets in with it.
    again = _accept(world.people.outsider, token)
    assert again.status_code == 400 and "no longer valid" in again.json()["token"][0]
    assert not Membership.objects.filter(tenant=world.people.tenant, user=world.people.outsider)
    assert _accept(world.people.outsider, "made-up").status_code == 400


def test_the_dashboard_link_of_an_api_invitation_joins(world: World) -> None:
    from django.test import Client

    url = _invite(client_for(world.people.admin), "finance").json()["url"]
    browser = Client()
    browser.force_login(world.people.outsider)
    path = url.removeprefix("http://testserver")
    assert browser.post(path).status_code == 302
    assert Membership.objects.get(tenant=world.people.tenant, user=world.people.outsider).role == (
        Role.FINANCE
    )


def test_only_owners_invite_owners_and_revoking_stops_a_link(world: World) -> None:
    admin = client_for(world.people.admin)
    refused = _invite(admin, "owner")
    assert refused.status_code == 403 and not Invitation.objects.filter(role=Role.OWNER)
    made = _invite(client_for(world.people.owner), "owner").json()
    revoked = admin.post(
        reverse("tenants:invitation-revoke", kwargs={"slug": "acme", "invitation_id": made["id"]})
    )
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    assert _accept(world.people.outsider, made["token"]).status_code == 400
    assert made["id"] not in [i["id"] for i in _pending(admin)]


def test_removing_or_demoting_an_inviter_revokes_their_pending_invitations(world: World) -> None:
    people = world.people
    owner = client_for(people.owner)
    # A second owner sends an owner and a viewer invitation, the admin a developer one.
    second = _membership(people, "developer")
    owner.post(
        reverse("tenants:member-update", kwargs={"slug": "acme", "membership_id": second.pk}),
        {"role": "owner"},
        format="json",
    )
    as_owner = _invite(client_for(people.developer), "owner").json()
    as_viewer = _invite(client_for(people.developer), "viewer").json()
    by_admin = _invite(client_for(people.admin), "developer").json()

    # Demoted to admin: may no longer grant "owner", still may grant "viewer".
    owner.post(
        reverse("tenants:member-update", kwargs={"slug": "acme", "membership_id": second.pk}),
        {"role": "admin"},
        format="json",
    )
    pending = {i["id"] for i in _pending(owner)}
    assert as_owner["id"] not in pending and as_viewer["id"] in pending
    # Demoted to a role that cannot invite: the rest goes too.
    owner.post(
        reverse("tenants:member-update", kwargs={"slug": "acme", "membership_id": second.pk}),
        {"role": "viewer"},
        format="json",
    )
    assert as_viewer["id"] not in {i["id"] for i in _pending(owner)}
    # Removed: everything the admin sent is revoked.
    admin_m = _membership(people, "admin")
    owner.post(
        reverse("tenants:member-remove", kwargs={"slug": "acme", "membership_id": admin_m.pk})
    )
    assert by_admin["id"] not in {i["id"] for i in _pending(owner)}
    for made in (as_owner, as_viewer, by_admin):
        assert Invitation.objects.get(pk=made["id"]).revoked_at is not None
        assert _accept(people.outsider, made["token"]).status_code == 400
    assert not Membership.objects.filter(tenant=people.tenant, user=people.outsider).exists()
    reasons = AuditEvent.objects.filter(action="invitation.revoke").values_list(
        "details__reason", flat=True
    )
    assert set(reasons) == {"inviter now admin", "inviter now viewer", "inviter removed"}
    # The owner's own invitation (from the fixture) is untouched.
    assert world.invitation.pk in {i["id"] for i in _pending(owner)}


@pytest.mark.parametrize("change", ["role", "deactivated", "staff"])
def test_accepting_checks_that_the_inviter_still_may_invite(world: World, change: str) -> None:
    """However the inviter lost the right (a role changed outside the services, an account
    deactivated, staff rights taken away), their link no longer works."""
    people = world.people
    inviter = people.staff if change == "staff" else people.admin
    token = _invite(client_for(inviter), "developer").json()["token"]
    if change == "role":
        Membership.objects.filter(tenant=people.tenant, user=inviter).update(role=Role.FINANCE)
    elif change == "deactivated":
        User.objects.filter(pk=inviter.pk).update(is_active=False)
    else:
        User.objects.filter(pk=inviter.pk).update(is_staff=False)
    refused = _accept(people.outsider, token)
    assert refused.status_code == 400
    assert "may no longer invite" in refused.json()["token"][0]
    assert not Membership.objects.filter(tenant=people.tenant, user=people.outsider).exists()


# --- Bad input -------------------------------------------------------------------------------

BAD: list[tuple[str, str, str, Any, str]] = [
    ("key-create", "", "owner", {"name": ""}, "name"),
    ("key-create", "", "owner", {"name": "k", "scopes": ["root"]}, "scopes"),
    ("key-create", "", "owner", {"name": "k", "scopes": []}, "scopes"),
    ("key-create", "", "owner", {"name": "k", "rpm": -1}, "rpm"),
    ("key-create", "", "owner", {"name": "k", "rpm": "lots"}, "rpm"),
    ("key-create", "", "owner", {"name": "k", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
    ("key-create", "", "owner", {"name": "k", "expires_at": "tomorrow"}, "expires_at"),
    ("key-create", "", "owner", {"name": "x" * 101}, "name"),
    ("key-rotate", "key", "owner", {"grace_period_seconds": -5}, "grace_period_seconds"),
    ("key-limits-update", "key", "owner", {"tpm": 0}, "tpm"),
    (
        "key-limits-update",
        "key",
        "owner",
        {"monthly_spend_budget_usd": "1.2.3"},
        "monthly_spend_budget_usd",
    ),
    (
        "key-limits-update",
        "key",
        "owner",
        {"monthly_spend_budget_usd": "0.0000001"},
        "monthly_spend_budget_usd",
    ),
    ("tenant-limits-update", "", "staff", {"max_concurrency": 10**12}, "max_concurrency"),
    ("tenant-update", "", "staff", {"status": "deleted"}, "status"),
    ("tenant-update", "", "staff", {"weight": 0}, "weight"),
    ("invitation-create", "", "owner", {"role": "god"}, "role"),
    ("invitation-create", "", "owner", {}, "role"),
    ("member-update", "member", "owner", {"role": ""}, "role"),
]


@pytest.mark.parametrize(("name", "needs", "persona", "body", "field"), BAD)
def test_bad_input_gets_400_with_field_error_and_changes_nothing(
    world: World, name: str, needs: str, persona: str, body: Any, field: str
) -> None:
    before = AuditEvent.objects.count(), ApiKey.objects.count()
    response = client_for(world.people.user(persona)).post(
        reverse(f"tenants:{name}", kwargs=world.kwargs(needs)), body, format="json"
    )
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert (AuditEvent.objects.count(), ApiKey.objects.count()) == before


def test_malformed_json_gets_400(world: World) -> None:
    response = client_for(world.people.owner).post(
        reverse("tenants:key-create", kwargs={"slug": "acme"}),
        data="{not json",
        content_type="application/json",
    )
    assert response.status_code == 400
    assert "JSON parse error" in response.json()["detail"]


def test_rotating_a_revoked_key_is_400(world: World) -> None:
    client = client_for(world.people.owner)
    kw = {"slug": "acme", "key_id": world.key.pk}
    client.post(reverse("tenants:key-revoke", kwargs=kw))
    response = client.post(reverse("tenants:key-rotate", kwargs=kw))
    assert response.status_code == 400
    assert "active" in response.json()["key"][0]


def test_duplicate_tenant_slug_is_400(world: World) -> None:
    response = client_for(world.people.staff).post(
        reverse("tenants:tenant-create"), {"slug": "acme"}, format="json"
    )
    assert response.status_code == 400
    assert "already exists" in response.json()["slug"][0]


# --- Audit ---------------------------------------------------------------------------------

AUDITED: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("tenant-update", "", {"weight": 4}, "staff", "tenant.update"),
    ("tenant-limits-update", "", {"tpm": 100}, "staff", "tenant.limits"),
    ("invitation-create", "", {"role": "viewer"}, "owner", "invitation.create"),
    ("invitation-revoke", "invitation", {}, "admin", "invitation.revoke"),
    ("member-update", "member", {"role": "viewer"}, "admin", "member.role"),
    ("member-remove", "member", {}, "owner", "member.remove"),
    ("key-create", "", {"name": "k"}, "developer", "api_key.create"),
    ("key-revoke", "key", {}, "admin", "api_key.revoke"),
    ("key-rotate", "key", {}, "owner", "api_key.rotate"),
    ("key-limits-update", "key", {"rpm": 3}, "owner", "api_key.limits"),
]


@pytest.mark.parametrize(("name", "needs", "body", "persona", "action"), AUDITED)
def test_every_change_writes_an_audit_event(
    world: World, name: str, needs: str, body: dict[str, Any], persona: str, action: str
) -> None:
    actor = world.people.user(persona)
    response = client_for(actor).post(
        reverse(f"tenants:{name}", kwargs=world.kwargs(needs)), body, format="json"
    )
    assert response.status_code < 300, response.content
    event = AuditEvent.objects.filter(tenant=world.people.tenant, action=action).latest(
        "created_at"
    )
    assert event.actor == actor and event.actor_label == actor.username
    log = client_for(world.people.owner).get(
        reverse("tenants:audit-list", kwargs={"slug": "acme"}), {"action": action}
    )
    assert [e["action"] for e in log.json()["results"]][:1] == [action]


def test_audit_log_is_per_tenant(world: World) -> None:
    client_for(world.people.outsider).post(
        reverse("tenants:key-create", kwargs={"slug": "globex"}), {"name": "theirs"}, format="json"
    )
    actions: Callable[[str], list[str]] = lambda slug: [  # noqa: E731
        e["target"]
        for e in client_for(world.people.staff)
        .get(reverse("tenants:audit-list", kwargs={"slug": slug}))
        .json()["results"]
    ]
    assert not any("theirs" in target for target in actions("acme"))
    assert any("theirs" in target for target in actions("globex"))


# --- User tokens -----------------------------------------------------------------------------


def test_user_token_login_use_and_revoke(world: World, api: APIClient) -> None:
    api.credentials(HTTP_AUTHORIZATION="Basic " + _basic("owner", "correct horse battery staple"))
    token = api.post(reverse("token-create")).json()["token"]
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert api.get(reverse("tenants:tenant-detail", kwargs={"slug": "acme"})).status_code == 200
    assert api.post(reverse("token-revoke")).status_code == 204
    assert api.get(reverse("tenants:tenant-detail", kwargs={"slug": "acme"})).status_code == 401


def test_wrong_password_gets_no_token(world: World, api: APIClient) -> None:
    api.credentials(HTTP_AUTHORIZATION="Basic " + _basic("owner", "wrong"))
    assert api.post(reverse("token-create")).status_code == 401


def _basic(user: str, password: str) -> str:
    import base64

    return base64.b64encode(f"{user}:{password}".encode()).decode()


def test_openapi_schema_lists_the_operations(world: World, api: APIClient) -> None:
    response = api.get(reverse("schema"), {"format": "json"})
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert "/api/tenants/{slug}/keys/create/" in paths
    assert "/api/tenants/{slug}/keys/{key_id}/rotate/" in paths
    assert "/api/tenants/{slug}/invitations/create/" in paths
    assert "/api/invitations/accept/" in paths
    assert "/api/tenants/{slug}/members/create/" not in paths


def test_a_keys_priority_class_is_its_tenants_or_lower_and_only_staff_raise_a_tenants(
    world: World,
) -> None:
    """The operator sets a tenant's class (a tier of service); its admins may narrow a key
    below it, never above; a key narrowed before a tenant was lowered runs in the lower."""
    tenant, key = world.people.tenant, world.key
    admin, staff = client_for(world.people.admin), client_for(world.people.staff)
    update = reverse("tenants:tenant-update", kwargs={"slug": tenant.slug})
    assert admin.post(update, {"priority_class": "interactive"}, format="json").status_code == 403
    url = reverse("tenants:key-priority-update", kwargs={"slug": tenant.slug, "key_id": key.pk})
    refused = admin.post(url, {"priority_class": "interactive"}, format="json")
    assert refused.status_code == 400
    assert "standard" in refused.json()["priority_class"][0]  # what it may be, said
    answer = admin.post(url, {"priority_class": "background"}, format="json").json()
    assert answer["priority_class"] == answer["effective_priority_class"] == "background"
    assert admin.post(url, {"priority_class": "urgent"}, format="json").status_code == 400
    assert staff.post(update, {"priority_class": "interactive"}, format="json").status_code == 200
    answer = admin.post(url, {"priority_class": "interactive"}, format="json").json()
    assert answer["effective_priority_class"] == "interactive"
    staff.post(update, {"priority_class": "background"}, format="json")
    detail = reverse("tenants:key-detail", kwargs={"slug": tenant.slug, "key_id": key.pk})
    assert admin.get(detail).json()["effective_priority_class"] == "background"
    actions = set(AuditEvent.objects.filter(tenant=tenant).values_list("action", flat=True))
    assert {"api_key.priority", "tenant.update"} <= actions
