"""Dashboard pages, server side: who sees what, outsiders get 404, forms refuse bad input with
form errors, and an API key's secret is shown once."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone

from adapters.models import Adapter
from contract import UsageRecord
from dashboard.templatetags.dashboard_tags import money, plain
from devkit.adapters import config, lora_tensors, safetensors
from tenants.models import ApiKey, AuditEvent, Invitation, Membership, User
from tenants.services import api_key_create, api_key_revoke
from tests.adapters.test_adapters import served  # noqa: F401  (fixture)
from tests.billing.test_usage import _record, insert_with_rollups
from tests.conftest import TenantPeople

pytestmark = pytest.mark.django_db

PAGES = ["", "keys/", "members/", "adapters/"]


def browser(user: User | None) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


def test_pages_need_a_login() -> None:
    for url in ("/app/", "/app/t/acme/", "/app/t/acme/keys/"):
        response = browser(None).get(url)
        assert response.status_code == 302 and response["Location"].startswith("/app/login/")
    assert browser(None).get("/app/login/").status_code == 200


def test_login_with_a_wrong_password_is_a_form_error(people: TenantPeople) -> None:
    response = browser(None).post("/app/login/", {"username": "owner", "password": "nope"})
    assert response.status_code == 200 and b"Please enter a correct username" in response.content
    good = browser(None).post(
        "/app/login/", {"username": "owner", "password": "correct horse battery staple"}
    )
    assert good.status_code == 302 and good["Location"] == "/app/"


@pytest.mark.parametrize("persona", ["owner", "admin", "developer", "finance", "viewer", "staff"])
def test_members_and_staff_see_every_page(people: TenantPeople, persona: str) -> None:
    client = browser(people.user(persona))
    for page in PAGES:
        response = client.get(f"/app/t/acme/{page}")
        assert response.status_code == 200, page
        assert b"Acme" in response.content


def test_an_outsider_gets_404_for_every_page_and_action(people: TenantPeople) -> None:
    key = api_key_create(tenant=people.tenant, name="k", created_by=people.owner).api_key
    client = browser(people.outsider)
    for page in PAGES:
        assert client.get(f"/app/t/acme/{page}").status_code == 404
    for action in (
        "keys/",
        f"keys/{key.pk}/revoke/",
        f"keys/{key.pk}/rotate/",
        "adapters/",
        "adapters/bot/1/delete/",
        "members/",
        f"members/{people.tenant.memberships.get(role='owner').pk}/role/",
        f"members/{people.tenant.memberships.get(role='owner').pk}/remove/",
    ):
        assert client.post(f"/app/t/acme/{action}", {"name": "x"}).status_code == 404
    assert client.get("/app/t/no-such-tenant/").status_code == 404
    assert client.get("/app/t/acme/?fragment=1").status_code == 404  # the overview's tiles
    tiles = browser(people.viewer).get("/app/t/acme/?fragment=1").content.decode()
    assert tiles.startswith('<section class="tiles" id="tiles" hx-get=') and "<html" not in tiles
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None
    assert ApiKey.objects.filter(tenant=people.tenant).count() == 1


def test_home_takes_a_user_to_their_tenant(people: TenantPeople) -> None:
    response = browser(people.viewer).get("/app/")
    assert response.status_code == 302 and response["Location"] == "/app/t/acme/"
    lonely = User.objects.create_user("lonely", password="x")
    assert b"No tenant yet" in browser(lonely).get("/app/").content


def test_a_new_key_is_shown_once_then_only_its_prefix(people: TenantPeople) -> None:
    client = browser(people.developer)
    response = client.post("/app/t/acme/keys/", {"name": "support bot", "scopes": ["inference"]})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(tenant=people.tenant)
    body = response.content.decode()
    secret = body.split("data-secret>")[1].split("<")[0]
    assert secret.startswith("sk-ip-") and key.prefix in secret
    assert key.scopes == ["inference"] and key.created_by == people.developer
    again = client.get("/app/t/acme/keys/").content.decode()
    assert secret not in again and key.display_prefix in again


@pytest.mark.parametrize("persona", ["finance", "viewer"])
def test_roles_without_key_creation_see_no_form_and_cannot_post(
    people: TenantPeople, persona: str
) -> None:
    client = browser(people.user(persona))
    assert b"Create a key" not in client.get("/app/t/acme/keys/").content
    assert (
        client.post("/app/t/acme/keys/", {"name": "x", "scopes": ["inference"]}).status_code == 403
    )
    assert not ApiKey.objects.exists()


def test_bad_key_input_gets_form_errors(people: TenantPeople) -> None:
    client = browser(people.owner)
    response = client.post("/app/t/acme/keys/", {"name": "", "scopes": ["nonsense"]})
    assert response.status_code == 400
    assert b"This field is required" in response.content
    assert b"Select a valid choice" in response.content
    assert not ApiKey.objects.exists()


def test_developers_revoke_their_own_keys_only(people: TenantPeople) -> None:
    mine = api_key_create(tenant=people.tenant, name="mine", created_by=people.developer).api_key
    theirs = api_key_create(tenant=people.tenant, name="theirs", created_by=people.owner).api_key
    client = browser(people.developer)
    page = client.get("/app/t/acme/keys/").content.decode()
    assert f"keys/{mine.pk}/revoke/" in page and f"keys/{theirs.pk}/revoke/" not in page
    assert client.post(f"/app/t/acme/keys/{theirs.pk}/revoke/").status_code == 403
    assert client.post(f"/app/t/acme/keys/{mine.pk}/revoke/").status_code == 302
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert mine.revoked_at is not None and theirs.revoked_at is None
    assert browser(people.owner).post(f"/app/t/acme/keys/{theirs.pk}/revoke/").status_code == 302


def test_rotating_shows_the_new_key_once_and_keeps_the_old_for_the_grace(
    people: TenantPeople,
) -> None:
    old = api_key_create(tenant=people.tenant, name="svc", created_by=people.owner).api_key
    response = browser(people.owner).post(
        f"/app/t/acme/keys/{old.pk}/rotate/", {"grace_hours": "2"}
    )
    assert response.status_code == 200
    new = ApiKey.objects.get(rotated_from=old)
    assert f"sk-ip-{new.prefix}".encode() in response.content
    old.refresh_from_db()
    assert old.expires_at is not None
    assert timedelta(hours=1.9) < old.expires_at - timezone.now() < timedelta(hours=2.1)
    bad = browser(people.owner).post(f"/app/t/acme/keys/{new.pk}/rotate/", {"grace_hours": "-1"})
    assert bad.status_code == 400


def test_overview_numbers_and_chart_come_from_the_rollups(people: TenantPeople) -> None:
    now = datetime.now(UTC).isoformat()
    insert_with_rollups(
        [
            _record(
                people.tenant,
                status="ok" if i else "error",
                error="" if i else "engine failed mid-stream: boom",
                prompt_tokens=100,
                completion_tokens=20,
                cost_micros=1_500_000,
                started_at=now,
                finished_at=now,
            )
            for i in range(3)
        ]
    )
    page = browser(people.viewer).get("/app/t/acme/").content.decode()
    assert 'data-metric="requests">3<' in page and 'data-metric="tokens">360<' in page
    assert 'data-metric="spend">$4.50<' in page
    assert "engine failed mid-stream: boom" in page
    assert '"model": "tiny-chat"' in page and "360" in page.split('id="usage-data"')[1]


def test_spend_is_shown_to_the_precision_it_has(people: TenantPeople) -> None:
    """A month of sub-cent requests is not "$0.00": the tile says what the table says."""
    now = datetime.now(UTC).isoformat()
    insert_with_rollups(
        [_record(people.tenant, cost_micros=900, started_at=now, finished_at=now) for _ in range(2)]
    )
    page = browser(people.viewer).get("/app/t/acme/").content.decode()
    assert 'data-metric="spend">$0.0018<' in page
    usage = browser(people.owner).get("/app/t/acme/usage/").content.decode()
    assert 'data-total="spend">$0.0018<' in usage


@pytest.mark.parametrize(
    ("micros", "shown"),
    [
        (0, "$0.00"),
        (4_500_000, "$4.50"),
        (1_800, "$0.0018"),
        (7_835, "$0.007835"),
        (1_204_000_000, "$1,204.00"),
        (12_345_678, "$12.345678"),
        (-10_000, "-$0.01"),
    ],
)
def test_money_keeps_every_digit_the_ledger_has(micros: int, shown: str) -> None:
    assert money(micros) == shown


def test_a_price_is_written_plainly() -> None:
    assert [plain(Decimal(v)) for v in ("10.000000", "0.150000", "0E-6", "12.50")] == [
        "10",
        "0.15",
        "0",
        "12.5",
    ]


def test_adapter_upload_form_and_delete(
    people: TenantPeople,
    served: Path,  # noqa: F811
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = browser(people.developer)
    bad = client.post("/app/t/acme/adapters/", {"name": "Bad Name!"})
    assert bad.status_code == 400 and not Adapter.objects.exists()
    with django_capture_on_commit_callbacks():
        response = client.post(
            "/app/t/acme/adapters/",
            {
                "name": "bot",
                "adapter_config": SimpleUploadedFile("adapter_config.json", config()),
                "adapter_model": SimpleUploadedFile(
                    "adapter_model.safetensors", safetensors(lora_tensors())
                ),
            },
        )
    assert response.status_code == 302
    adapter = Adapter.objects.get(tenant=people.tenant, name="bot")
    rows = client.get("/app/t/acme/adapters/rows/").content.decode()
    assert "validating" in rows and 'hx-trigger="every 2s"' in rows
    viewer = browser(people.viewer)
    assert b"Upload a version" not in viewer.get("/app/t/acme/adapters/").content
    assert viewer.post("/app/t/acme/adapters/bot/1/delete/").status_code == 403
    with django_capture_on_commit_callbacks():
        assert client.post("/app/t/acme/adapters/bot/1/delete/").status_code == 302
    adapter.refresh_from_db()
    assert adapter.deleted_at is not None


def test_an_oversized_upload_is_refused_before_it_is_read(
    people: TenantPeople,
    served: Path,  # noqa: F811
    settings: Any,
) -> None:
    settings.ADAPTER_MAX_BYTES = 1000
    response = browser(people.owner).post(
        "/app/t/acme/adapters/",
        {"name": "bot", "archive": SimpleUploadedFile("a.zip", b"x" * 5000)},
    )
    assert response.status_code == 413 and b"limited to 1,000 bytes" in response.content
    assert not Adapter.objects.exists()


def _invite(client: Client, role: str) -> str:
    response = client.post("/app/t/acme/members/", {"role": role})
    assert response.status_code == 200, response.content
    assert response["Cache-Control"] == "no-store"
    return response.content.decode().split("data-join-url>")[1].split("<")[0]


def test_an_invitation_link_makes_one_new_member_once(people: TenantPeople) -> None:
    link = _invite(browser(people.admin), "developer")
    assert link.startswith("http://testserver/app/join/")
    path = link.removeprefix("http://testserver")
    assert people.tenant.name.encode() in browser(None).get(path).content
    newcomer = browser(None)
    joined = newcomer.post(
        path,
        {
            "username": "newcomer",
            "email": "new@example.com",
            "password1": "a long enough pass phrase",
            "password2": "a long enough pass phrase",
        },
    )
    assert joined.status_code == 302 and joined["Location"] == "/app/t/acme/"
    member = Membership.objects.get(tenant=people.tenant, user__username="newcomer")
    assert member.role == "developer"
    assert newcomer.get("/app/t/acme/").status_code == 200  # logged in by joining
    # Used up: nobody else gets in with it, and the page says why.
    again = browser(people.outsider).get(path)
    assert again.status_code == 404 and b"not valid" in again.content
    assert browser(people.outsider).post(path).status_code == 404
    assert not Membership.objects.filter(tenant=people.tenant, user=people.outsider).exists()
    assert browser(None).get("/app/join/made-up-token/").status_code == 404


def test_a_logged_in_user_joins_with_one_click_and_bad_signups_get_form_errors(
    people: TenantPeople,
) -> None:
    path = _invite(browser(people.owner), "viewer").removeprefix("http://testserver")
    bad = browser(None).post(path, {"username": "x", "password1": "a", "password2": "b"})
    assert bad.status_code == 400 and b"didn" in bad.content  # passwords didn't match
    assert not User.objects.filter(username="x").exists()
    assert browser(people.outsider).post(path).status_code == 302
    assert Membership.objects.get(tenant=people.tenant, user=people.outsider).role == "viewer"


def test_only_owners_invite_or_make_owners_and_the_last_owner_stays(
    people: TenantPeople,
) -> None:
    admin = browser(people.admin)
    assert admin.post("/app/t/acme/members/", {"role": "owner"}).status_code == 403
    assert not Invitation.objects.exists()
    developer = people.tenant.memberships.get(user=people.developer)
    assert (
        admin.post(f"/app/t/acme/members/{developer.pk}/role/", {"role": "owner"}).status_code
        == 403
    )
    assert (
        admin.post(f"/app/t/acme/members/{developer.pk}/role/", {"role": "admin"}).status_code
        == 302
    )
    developer.refresh_from_db()
    assert developer.role == "admin"

    owner = people.tenant.memberships.get(role="owner")
    response = browser(people.owner).post(f"/app/t/acme/members/{owner.pk}/remove/")
    assert response.status_code == 400 and b"last owner cannot be removed" in response.content
    demoted = browser(people.owner).post(
        f"/app/t/acme/members/{owner.pk}/role/", {"role": "viewer"}
    )
    assert demoted.status_code == 400 and b"at least one owner" in demoted.content
    assert Membership.objects.get(pk=owner.pk).role == "owner"


@pytest.mark.parametrize("persona", ["developer", "finance", "viewer"])
def test_members_without_the_right_see_the_list_but_cannot_change_it(
    people: TenantPeople, persona: str
) -> None:
    client = browser(people.user(persona))
    page = client.get("/app/t/acme/members/").content
    assert b"owner" in page and b"Create invitation link" not in page
    assert client.post("/app/t/acme/members/", {"role": "viewer"}).status_code == 403
    target = people.tenant.memberships.get(user=people.viewer)
    assert client.post(f"/app/t/acme/members/{target.pk}/remove/").status_code == 403
    assert Membership.objects.filter(pk=target.pk).exists()


def test_an_admin_is_offered_no_change_it_may_not_make_to_an_owner(people: TenantPeople) -> None:
    page = browser(people.admin).get("/app/t/acme/members/").content.decode()
    rows = {row.split('"', 1)[0]: row for row in page.split('<tr data-member="')[1:]}
    assert "Remove" not in rows["owner"] and "Change" not in rows["owner"]
    assert "Remove" in rows["viewer"] and "Change" in rows["viewer"]
    owner_page = browser(people.owner).get("/app/t/acme/members/").content.decode()
    assert "Remove" in owner_page.split('<tr data-member="owner"')[1].split("</tr>")[0]


def test_revoked_invitations_do_not_work(people: TenantPeople) -> None:
    path = _invite(browser(people.owner), "developer").removeprefix("http://testserver")
    invitation = Invitation.objects.get()
    assert (
        browser(people.admin).post(f"/app/t/acme/invitations/{invitation.pk}/revoke/").status_code
        == 302
    )
    assert browser(people.outsider).get(path).status_code == 404
    assert (
        browser(people.outsider)
        .post(f"/app/t/acme/invitations/{invitation.pk}/revoke/")
        .status_code
        == 404
    )


def test_an_inviters_links_die_with_their_right_to_invite(people: TenantPeople) -> None:
    removed = _invite(browser(people.admin), "developer").removeprefix("http://testserver")
    demoted = _invite(browser(people.owner), "viewer").removeprefix("http://testserver")
    admin = people.tenant.memberships.get(user=people.admin)
    assert browser(people.owner).post(f"/app/t/acme/members/{admin.pk}/remove/").status_code == 302
    # The owner demotes a second owner, who had sent a link, to viewer.
    second = people.tenant.memberships.get(user=people.developer)
    owner = browser(people.owner)
    assert owner.post(f"/app/t/acme/members/{second.pk}/role/", {"role": "owner"}).status_code
    later = _invite(browser(people.developer), "finance").removeprefix("http://testserver")
    owner.post(f"/app/t/acme/members/{second.pk}/role/", {"role": "viewer"})
    for path in (removed, later):
        page = browser(people.outsider).get(path)
        assert page.status_code == 404 and b"no longer valid" in page.content
        assert browser(people.outsider).post(path).status_code == 404
    assert not Membership.objects.filter(tenant=people.tenant, user=people.outsider).exists()
    # The remaining owner's own link still works.
    assert browser(people.outsider).post(demoted).status_code == 302


def test_the_audit_log_shows_who_did_what_filtered(people: TenantPeople) -> None:
    owner = browser(people.owner)
    owner.post("/app/t/acme/keys/", {"name": "audited", "scopes": ["inference"]})
    key = ApiKey.objects.get(name="audited")
    owner.post(f"/app/t/acme/keys/{key.pk}/revoke/")
    page = owner.get("/app/t/acme/audit/").content.decode()
    assert 'data-action="api_key.create"' in page and 'data-action="api_key.revoke"' in page
    only = owner.get("/app/t/acme/audit/?action=api_key.rev").content.decode()
    assert 'data-action="api_key.revoke"' in only and 'data-action="api_key.create"' not in only
    nobody = owner.get("/app/t/acme/audit/?actor=someone-else").content.decode()
    assert "Nothing matches." in nobody
    bad = owner.get("/app/t/acme/audit/?since=yesterday")
    assert bad.status_code == 400 and b"Enter a valid date" in bad.content
    for persona in ("developer", "finance", "viewer"):
        assert browser(people.user(persona)).get("/app/t/acme/audit/").status_code == 403
    assert browser(people.outsider).get("/app/t/acme/audit/").status_code == 404


# --- Usage explorer and invoices -----------------------------------------------------------


def _usage_days(people: TenantPeople) -> tuple[ApiKey, ApiKey]:
    """Two keys; usage on two days, two models, both modes; another tenant's usage too."""
    first = api_key_create(tenant=people.tenant, name="first", created_by=people.owner).api_key
    second = api_key_create(tenant=people.tenant, name="second", created_by=people.owner).api_key
    today = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    yesterday = today - timedelta(days=1)

    def record(key: ApiKey | None, model: str, mode: str, when: datetime, cost: int) -> UsageRecord:
        return _record(
            people.other_tenant if key is None else people.tenant,
            api_key_id=key.pk if key else None,
            model=model,
            mode=mode,
            prompt_tokens=100,
            completion_tokens=10,
            cost_micros=cost,
            started_at=when.isoformat(),
            finished_at=when.isoformat(),
        )

    insert_with_rollups(
        [
            record(first, "tiny-chat", "online", yesterday, 1_000_000),
            record(first, "tiny-chat", "batch", today, 500_000),
            record(second, "other-model", "online", today, 2_000_000),
            record(None, "tiny-chat", "online", today, 9_000_000),  # another tenant's
        ]
    )
    return first, second


def _csv_rows(response: Any) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def test_the_usage_explorer_filters_and_its_csv_is_the_same_selection(
    people: TenantPeople,
) -> None:
    first, second = _usage_days(people)
    client = browser(people.finance)
    page = client.get("/app/t/acme/usage/")
    assert page.status_code == 200
    body = page.content.decode()
    assert 'data-total="requests">3<' in body and 'data-total="spend">$3.50<' in body
    rows = _csv_rows(client.get("/app/t/acme/usage.csv"))
    assert len(rows) == 3 and sum(float(r["cost_usd"]) for r in rows) == 3.5
    assert {r["api_key"] for r in rows} == {f"sk-ip-{first.prefix}", f"sk-ip-{second.prefix}"}
    names = {r["api_key"]: r["api_key_name"] for r in rows}  # keys by name, not prefix alone
    assert names[f"sk-ip-{first.prefix}"] == first.name and first.name in body
    # A name a spreadsheet would run as a formula stays text in the CSV.
    ApiKey.objects.filter(pk=first.pk).update(name='=HYPERLINK("http://evil","x")')
    rows = _csv_rows(client.get("/app/t/acme/usage.csv"))
    assert {r["api_key_name"] for r in rows} >= {'\'=HYPERLINK("http://evil","x")'}

    only = f"?model=tiny-chat&key={first.pk}&mode=batch"
    filtered = client.get(f"/app/t/acme/usage/{only}").content.decode()
    assert 'data-total="requests">1<' in filtered
    [row] = _csv_rows(client.get(f"/app/t/acme/usage.csv{only}"))
    assert (row["model"], row["mode"], row["cost_usd"]) == ("tiny-chat", "batch", "0.500000")
    assert "0.500000" in filtered  # the table shows the CSV's row

    today = datetime.now(UTC).date()
    one_day = client.get(f"/app/t/acme/usage.csv?start={today}&end={today}")
    assert len(_csv_rows(one_day)) == 2
    assert one_day["Content-Disposition"].startswith('attachment; filename="acme-usage-')


def test_bad_usage_filters_get_form_errors_not_500s(people: TenantPeople) -> None:
    _, _ = _usage_days(people)
    client = browser(people.owner)
    other_key = api_key_create(tenant=people.other_tenant, name="theirs", created_by=None).api_key
    for query, message in (
        ("start=2026-11-10&end=2026-11-01", b"on or after the start"),
        ("start=2020-01-01&end=2026-11-01", b"at most 366 days"),
        ("start=yesterday", b"Enter a valid date"),
        (f"key={other_key.pk}", b"No such key in this tenant"),  # no peeking at other tenants
        ("mode=spot", b"Select a valid choice"),
    ):
        page = client.get(f"/app/t/acme/usage/?{query}")
        assert page.status_code == 400 and message in page.content, query
        assert client.get(f"/app/t/acme/usage.csv?{query}").status_code == 400


@pytest.mark.parametrize(
    ("persona", "status"), [("developer", 403), ("viewer", 403), ("outsider", 404)]
)
def test_usage_and_invoices_are_for_billing_roles(
    people: TenantPeople, persona: str, status: int
) -> None:
    client = browser(people.user(persona))
    for url in ("usage/", "usage.csv", "invoices/", "invoices/1/"):
        assert client.get(f"/app/t/acme/{url}").status_code == status, url
    if status == 403:
        assert b"Invoices" not in client.get("/app/t/acme/").content  # no link either


def test_invoices_list_and_detail_with_lines(people: TenantPeople) -> None:
    from billing.invoicing import invoice_compute

    _usage_days(people)
    month = datetime.now(UTC).date().replace(day=1)
    invoice = invoice_compute(tenant=people.tenant, period_start=month)
    theirs = invoice_compute(tenant=people.other_tenant, period_start=month)
    client = browser(people.finance)
    listing = client.get("/app/t/acme/invoices/").content.decode()
    assert (
        f'data-invoice="{invoice.pk}"' in listing and f'data-invoice="{theirs.pk}"' not in listing
    )
    assert "draft" in listing
    detail = client.get(f"/app/t/acme/invoices/{invoice.pk}/").content.decode()
    assert (
        f"data-invoice-total>${invoice.total_cents // 100:,}.{invoice.total_cents % 100:02d} USD<"
        in detail
    )
    assert "other-model (online)" in detail and "tiny-chat (batch)" in detail
    assert f"/api/tenants/acme/invoices/{invoice.pk}/lines.csv" in detail
    assert client.get(f"/app/t/acme/invoices/{theirs.pk}/").status_code == 404


def test_limits_are_shown_to_members_and_changed_by_staff_only(people: TenantPeople) -> None:
    viewer = browser(people.viewer)
    page = viewer.get("/app/t/acme/limits/").content.decode()
    assert "Requests per minute" in page and "Change (platform staff)" not in page
    change = {
        "rpm": "120",
        "tpm": "",
        "max_concurrency": "8",
        "max_tokens_per_request": "",
        "monthly_token_budget": "",
        "monthly_spend_budget_usd": "250.50",
        "weight": "3",
        "status": "active",
    }
    for persona in ("owner", "admin"):  # tenant roles do not set their own limits
        assert browser(people.user(persona)).post("/app/t/acme/limits/", change).status_code == 403
    assert browser(people.outsider).post("/app/t/acme/limits/", change).status_code == 404

    staff = browser(people.staff)
    assert "Change (platform staff)" in staff.get("/app/t/acme/limits/").content.decode()
    assert staff.post("/app/t/acme/limits/", change).status_code == 302
    people.tenant.refresh_from_db()
    assert (people.tenant.rpm, people.tenant.tpm, people.tenant.max_concurrency) == (120, None, 8)
    assert people.tenant.monthly_spend_budget_micros == 250_500_000
    assert people.tenant.weight == 3
    assert "$250.50" in viewer.get("/app/t/acme/limits/").content.decode()

    bad = staff.post("/app/t/acme/limits/", {**change, "rpm": "-5", "weight": "0"})
    assert bad.status_code == 400 and b"greater than or equal to 1" in bad.content
    people.tenant.refresh_from_db()
    assert people.tenant.rpm == 120  # nothing changed

    suspend = staff.post("/app/t/acme/limits/", {**change, "status": "suspended"})
    assert suspend.status_code == 302
    people.tenant.refresh_from_db()
    assert not people.tenant.is_active
    assert b"suspended" in viewer.get("/app/t/acme/").content


def test_the_operator_page_is_for_platform_staff_only(people: TenantPeople) -> None:
    from inference.services import model_ensure, pool_ensure

    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool_ensure(name="online", kind="dedicated", model=model, replica_urls=["http://gpu-a:8000"])
    for persona in ("owner", "admin", "outsider"):
        assert browser(people.user(persona)).get("/app/ops/").status_code == 404
        assert b"Operator" not in browser(people.user(persona)).get("/app/").content
    page = browser(people.staff).get("/app/ops/").content.decode()
    assert 'data-pool="online"' in page and 'data-replica="http://gpu-a:8000"' in page
    assert "down" in page  # never probed
    assert "acme" in page and "globex" in page  # every tenant, with its limits link
    fragment = browser(people.staff).get("/app/ops/?fragment=1").content.decode()
    assert fragment.startswith('<div id="ops-live"') and "<html" not in fragment


def test_the_playground_key_is_short_lived_and_needs_key_rights(people: TenantPeople) -> None:
    from inference.services import model_ensure, pool_ensure

    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool_ensure(name="online", kind="dedicated", model=model, replica_urls=["http://gpu-a:8000"])
    guard = model_ensure(
        name="tiny-guard", served_name="tiny-guard", context_length=1024, task="classify"
    )
    pool_ensure(name="guard", kind="dedicated", model=guard, replica_urls=["http://gpu-b:8000"])
    Adapter.objects.create(
        tenant=people.tenant, name="bot", version=1, status="ready", base_model=model
    )
    Adapter.objects.create(
        tenant=people.other_tenant, name="theirs", version=1, status="ready", base_model=model
    )
    page = browser(people.viewer).get("/app/t/acme/playground/").content.decode()
    assert "cannot create API keys" in page
    developer = browser(people.developer)
    page = developer.get("/app/t/acme/playground/").content.decode()
    assert '<option value="tiny-chat">' in page and '<option value="acme/bot">' in page
    assert "theirs" not in page
    assert "tiny-guard" not in page  # a guard model only classifies: chat would refuse it
    answer = developer.post("/app/t/acme/playground/key/")
    assert answer.status_code == 200 and answer["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(tenant=people.tenant)
    assert answer.json()["key"].startswith(f"sk-ip-{key.prefix}")
    assert key.scopes == ["inference"] and key.name == "playground · developer"
    assert key.expires_at is not None
    assert timedelta(hours=11) < key.expires_at - timezone.now() < timedelta(hours=13)
    assert browser(people.viewer).post("/app/t/acme/playground/key/").status_code == 403
    assert browser(people.outsider).post("/app/t/acme/playground/key/").status_code == 404
    assert ApiKey.objects.count() == 1


def test_switching_tenant_keeps_the_page_the_role_there_allows(people: TenantPeople) -> None:
    """The owner of acme is finance at globex: the audit log stays the audit log where it may
    be read, and becomes globex's overview where it may not; an outsider's slug is no way in."""
    from tenants.models import Role

    Membership.objects.create(tenant=people.other_tenant, user=people.owner, role=Role.FINANCE)
    owner = browser(people.owner)
    page = owner.get("/app/t/acme/audit/").content.decode()
    assert "/app/?tenant=globex&amp;section=audit" in page
    assert owner.get("/app/?tenant=globex&section=usage")["Location"] == "/app/t/globex/usage/"
    assert owner.get("/app/?tenant=globex&section=audit")["Location"] == "/app/t/globex/"
    assert owner.get("/app/?tenant=acme&section=audit")["Location"] == "/app/t/acme/audit/"
    assert owner.get("/app/?tenant=acme&section=../ops")["Location"] == "/app/t/acme/"
    viewer = browser(people.viewer)  # globex is not one of the viewer's tenants
    assert viewer.get("/app/?tenant=globex&section=keys")["Location"] == "/app/t/acme/keys/"


def test_owners_narrow_a_key_s_limits_in_the_dashboard_with_the_api_s_rules(
    people: TenantPeople,
) -> None:
    key = api_key_create(tenant=people.tenant, name="svc", created_by=people.developer).api_key
    path = f"/app/t/acme/keys/{key.pk}/"
    owner = browser(people.owner)
    page = owner.get(path).content.decode()
    assert "Save the key" in page and key.display_prefix in page
    saved = owner.post(
        path,
        {
            "rpm": "30",
            "tpm": "",
            "monthly_spend_budget_usd": "2.500001",
            "priority_class": "background",
        },
        follow=True,
    )
    assert saved.status_code == 200
    key.refresh_from_db()
    assert (key.rpm, key.tpm, key.monthly_spend_budget_micros) == (30, None, 2_500_001)
    assert key.priority_class == "background"  # below the tenant's standard: allowed
    above = owner.post(path, {"rpm": "30", "priority_class": "interactive"})
    assert above.status_code == 400 and "may be narrowed to standard" in above.content.decode()
    key.refresh_from_db()
    assert key.priority_class == "background"
    assert "$2.500001" in saved.content.decode()
    event = AuditEvent.objects.get(action="api_key.limits")
    assert event.details["rpm"] == [None, 30]

    # Every bad field is named at once, and nothing changes.
    bad = owner.post(path, {"rpm": "0", "tpm": "x", "monthly_token_budget": "-5"})
    assert bad.status_code == 400
    errors = bad.content.decode().count('class="error"')
    assert errors == 3
    key.refresh_from_db()
    assert key.rpm == 30

    # A developer sees the key and its limits but changes nothing; outsiders see no key.
    developer = browser(people.developer)
    assert "Save the key" not in developer.get(path).content.decode()
    assert developer.post(path, {"rpm": "1000"}).status_code == 403
    assert browser(people.outsider).get(path).status_code == 404
    theirs = api_key_create(tenant=people.other_tenant, name="x", created_by=None).api_key
    assert owner.get(f"/app/t/acme/keys/{theirs.pk}/").status_code == 404
    key.refresh_from_db()
    assert key.rpm == 30


def test_a_key_made_in_the_dashboard_can_expire(people: TenantPeople) -> None:
    owner = browser(people.owner)
    made = owner.post(
        "/app/t/acme/keys/", {"name": "temp", "scopes": ["inference"], "expires_in_days": "7"}
    )
    assert made.status_code == 200
    key = ApiKey.objects.get(name="temp")
    assert key.expires_at is not None
    assert timedelta(days=6.9) < key.expires_at - timezone.now() < timedelta(days=7.1)
    refused = owner.post(
        "/app/t/acme/keys/", {"name": "t2", "scopes": ["inference"], "expires_in_days": "0"}
    )
    assert refused.status_code == 400 and not ApiKey.objects.filter(name="t2").exists()


def test_staff_finalize_and_void_an_invoice_in_the_dashboard_by_the_api_s_rules(
    people: TenantPeople,
) -> None:
    from billing.invoicing import invoice_compute
    from billing.models import Invoice

    this_month = datetime.now(UTC).date().replace(day=1)
    last_month = (this_month - timedelta(days=1)).replace(day=1)
    past = invoice_compute(tenant=people.tenant, period_start=last_month)
    current = invoice_compute(tenant=people.tenant, period_start=this_month)
    theirs = invoice_compute(tenant=people.other_tenant, period_start=last_month)
    staff = browser(people.staff)
    assert "Finalize" in staff.get(f"/app/t/acme/invoices/{past.pk}/").content.decode()
    assert (
        "Finalize"
        not in browser(people.finance).get(f"/app/t/acme/invoices/{past.pk}/").content.decode()
    )

    # Finance and owners read invoices; changing them is the operator's, as in the API.
    for person in (people.finance, people.owner):
        assert browser(person).post(f"/app/t/acme/invoices/{past.pk}/finalize/").status_code == 403
    assert browser(people.outsider).post(f"/app/t/acme/invoices/{past.pk}/void/").status_code == 404
    assert staff.post(f"/app/t/acme/invoices/{theirs.pk}/finalize/").status_code == 404
    assert staff.post(f"/app/t/acme/invoices/{past.pk}/delete/").status_code == 404

    # A draft cannot be voided, a month not over cannot be finalized: the reason, nothing done.
    refused = staff.post(f"/app/t/acme/invoices/{past.pk}/void/")
    assert refused.status_code == 400 and "nothing to void" in refused.content.decode()
    early = staff.post(f"/app/t/acme/invoices/{current.pk}/finalize/")
    assert early.status_code == 400 and "not over yet" in early.content.decode()
    assert Invoice.objects.get(pk=current.pk).status == "draft"
    page = staff.get(f"/app/t/acme/invoices/{current.pk}/").content.decode()
    assert "data-not-over" in page and ">Finalize</button>" not in page  # not offered yet

    assert staff.post(f"/app/t/acme/invoices/{past.pk}/finalize/").status_code == 302
    assert Invoice.objects.get(pk=past.pk).status == "finalized"
    assert staff.post(f"/app/t/acme/invoices/{past.pk}/void/").status_code == 302
    assert Invoice.objects.get(pk=past.pk).status == "void"
    assert Invoice.objects.get(pk=theirs.pk).status == "draft"


def test_expired_and_revoked_keys_fold_away_below_the_working_ones(people: TenantPeople) -> None:
    working = api_key_create(tenant=people.tenant, name="live", created_by=people.owner).api_key
    for i in range(3):  # three playground tabs, a day ago
        old = api_key_create(
            tenant=people.tenant, name=f"playground · tab{i}", created_by=people.owner
        ).api_key
        ApiKey.objects.filter(pk=old.pk).update(expires_at=timezone.now() - timedelta(hours=1))
    gone = api_key_create(tenant=people.tenant, name="gone", created_by=people.owner).api_key
    api_key_revoke(api_key=gone, actor=people.owner)
    page = browser(people.owner).get("/app/t/acme/keys/").content.decode()
    shown, folded = page.split('<details id="keys-ended">')
    assert f'data-prefix="{working.prefix}"' in shown and "playground ·" not in shown
    assert "Expired and revoked (4)" in folded and f'data-prefix="{gone.prefix}"' in folded


def test_the_operator_makes_a_tenant_on_its_page_and_lands_on_its_limits(
    people: TenantPeople,
) -> None:
    from tenants.models import Tenant

    staff = browser(people.staff)
    assert 'id="tenant-create"' in staff.get("/app/ops/").content.decode()
    made = staff.post("/app/ops/tenants/", {"slug": "initech", "name": "Initech", "weight": "3"})
    assert made.status_code == 302 and made["Location"] == "/app/t/initech/limits/"
    tenant = Tenant.objects.get(slug="initech")
    assert (tenant.name, tenant.weight) == ("Initech", 3)
    assert AuditEvent.objects.filter(action="tenant.create", tenant=tenant).exists()

    taken = staff.post("/app/ops/tenants/", {"slug": "initech", "weight": "1"})
    assert taken.status_code == 400 and "already exists" in taken.content.decode()
    bad = staff.post("/app/ops/tenants/", {"slug": "Not a slug!", "weight": "0"})
    assert bad.status_code == 400 and bad.content.decode().count('class="error"') >= 2
    assert Tenant.objects.count() == 3  # acme, globex, initech
    # Tenant users do not learn the page exists.
    assert browser(people.owner).post("/app/ops/tenants/", {"slug": "x"}).status_code == 404


def test_the_operator_reads_and_adds_to_the_price_book_by_the_service_s_rules(
    people: TenantPeople,
) -> None:
    from billing.models import Price
    from inference.services import model_ensure

    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    staff = browser(people.staff)
    assert "No prices" in staff.get("/app/ops/prices/").content.decode()
    body = {"model": "tiny-chat", "input_per_mtok": "0.15", "output_per_mtok": "0.6"}
    added = staff.post("/app/ops/prices/", {**body, "batch_discount_percent": "50"})
    assert added.status_code == 302
    price = Price.objects.get()
    assert (price.model, price.tenant, price.cached_input_per_mtok) == (
        model,
        None,
        Decimal("0.15"),
    )
    page = staff.get("/app/ops/prices/").content.decode()
    assert "$0.15" in page and "$0.6" in page and "list price" in page and "50%" in page

    contract = {**body, "tenant": "acme", "batch_discount_percent": "0"}
    assert staff.post("/app/ops/prices/", contract).status_code == 302
    assert Price.objects.get(tenant=people.tenant).input_per_mtok == Decimal("0.15")
    # The classes' percentages: blank is 0 (above); a surcharge may pass 100%, a discount not.
    classes = {
        **contract,
        "interactive_surcharge_percent": "150",
        "background_discount_percent": "20",
    }
    assert staff.post("/app/ops/prices/", classes).status_code == 302
    latest = Price.objects.filter(tenant=people.tenant).latest("pk")
    assert (latest.interactive_surcharge_percent, latest.background_discount_percent) == (
        Decimal(150),
        Decimal(20),
    )
    over = staff.post("/app/ops/prices/", {**classes, "background_discount_percent": "101"})
    assert over.status_code == 400

    # The past is never repriced; an unknown tenant or model is named; nothing is added.
    past = staff.post(
        "/app/ops/prices/",
        {**body, "batch_discount_percent": "0", "effective_from": "2020-01-01 00:00"},
    )
    assert past.status_code == 400 and "cannot start in the past" in past.content.decode()
    nobody = staff.post("/app/ops/prices/", {**contract, "tenant": "nobody"})
    assert nobody.status_code == 400 and "No tenant with slug" in nobody.content.decode()
    assert staff.post("/app/ops/prices/", {**contract, "model": "nope"}).status_code == 400
    assert Price.objects.count() == 3
    assert browser(people.owner).get("/app/ops/prices/").status_code == 404


def test_the_operator_runs_a_pool_from_its_page_by_the_service_s_rules(
    people: TenantPeople,
) -> None:
    """Add a replica, drain it, remove it, resize the pool: each through the service the
    control API and the commands call, refused with the reason and nothing changed when
    wrong, and each in the pool's changes with who did it. Nobody else sees the page."""
    from fleet.models import Pool, Replica
    from inference.services import model_ensure, pool_ensure

    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool_ensure(name="online", kind="dedicated", model=model, replica_urls=["http://gpu-a:8000"])
    staff = browser(people.staff)
    page = staff.get("/app/ops/pools/online/").content.decode()
    assert 'data-replica="http://gpu-a:8000"' in page and ">Drain</button>" in page
    assert 'href="/app/ops/pools/online/"' in staff.get("/app/ops/").content.decode()

    bad = staff.post("/app/ops/pools/online/replicas/", {"url": "gpu-b"})
    assert bad.status_code == 400 and 'class="error"' in bad.content.decode()
    again = staff.post("/app/ops/pools/online/replicas/", {"url": "http://gpu-a:8000"})
    assert again.status_code == 400 and "already a replica of pool online" in again.content.decode()
    added = staff.post("/app/ops/pools/online/replicas/", {"url": "http://gpu-b:8000/"})
    assert added.status_code == 302
    replica = Replica.objects.get(url="http://gpu-b:8000")
    assert replica.state == Replica.State.DOWN  # until its first probe answers
    base = f"/app/ops/pools/online/replicas/{replica.pk}"
    assert staff.post(f"{base}/drain/").status_code == 302
    assert Replica.objects.get(pk=replica.pk).state == Replica.State.DRAINING
    assert staff.post(f"{base}/reboot/").status_code == 404
    assert staff.post("/app/ops/pools/spot/replicas/1/drain/").status_code == 404
    assert staff.post(f"{base}/remove/").status_code == 302
    assert not Replica.objects.filter(pk=replica.pk).exists()

    settings = {
        "max_inflight": "0",
        "policy": "fcfs",
        "max_queue_wait_seconds": "30",
        "max_loras": "4",
        "max_lora_rank": "8",
        "drain_grace_seconds": "300",
        "lend_percent": "0",
        "replicas_from": "static",
    }
    refused = staff.post("/app/ops/pools/online/", settings)
    assert refused.status_code == 400 and "greater than or equal to 1" in refused.content.decode()
    dns = staff.post(
        "/app/ops/pools/online/", {**settings, "max_inflight": "16", "replicas_from": "ftp://x"}
    )
    assert dns.status_code == 400
    assert Pool.objects.get(name="online").max_inflight == 8  # nothing changed
    over = staff.post("/app/ops/pools/online/", {**settings, "lend_percent": "101"})
    assert over.status_code == 400 and "less than or equal to 100" in over.content.decode()
    changed = {**settings, "max_inflight": "16", "lend_percent": "25"}
    assert staff.post("/app/ops/pools/online/", changed).status_code == 302
    pool = Pool.objects.get(name="online")
    assert (pool.max_inflight, pool.policy, pool.lend_percent) == (16, "fcfs", 25)

    events = list(AuditEvent.objects.filter(tenant=None).order_by("id"))
    assert [(e.action, e.actor_label) for e in events] == [
        ("replica.add", "operator"),
        ("replica.drain", "operator"),
        ("replica.remove", "operator"),
        ("pool.configure", "operator"),
    ]
    assert events[-1].details == {
        "max_inflight": [8, 16],
        "policy": ["vtc", "fcfs"],
        "lend_percent": [0, 25],
    }
    changes = staff.get("/app/ops/pools/online/").content.decode().split('id="pool-changes"')[1]
    assert changes.count("<tr data-action=") == 4 and "http://gpu-b:8000" in changes

    for persona in ("owner", "admin", "outsider"):
        client = browser(people.user(persona))
        assert client.get("/app/ops/pools/online/").status_code == 404
        assert client.get("/app/ops/pools/online/?fragment=1").status_code == 404
        assert (
            client.post("/app/ops/pools/online/", {**settings, "max_inflight": "1"}).status_code
            == 404
        )
        assert (
            client.post("/app/ops/pools/online/replicas/", {"url": "http://gpu-c:8000"}).status_code
            == 404
        )
        gpu_a = Replica.objects.get(url="http://gpu-a:8000")
        assert client.post(f"/app/ops/pools/online/replicas/{gpu_a.pk}/remove/").status_code == 404
    assert Pool.objects.get(name="online").max_inflight == 16
    assert Replica.objects.filter(pool__name="online").count() == 1
    assert AuditEvent.objects.filter(tenant=None).count() == 4


def test_every_route_change_is_kept_with_who_made_it(people: TenantPeople) -> None:
    """The operator page's recent changes are the routes' history: each weight move, from the
    dashboard or the control API, with its weights before and after."""
    from rest_framework.test import APIClient

    from inference.services import model_ensure

    model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    model_ensure(name="tiny-chat-next", served_name="tiny-chat-next", context_length=1024)
    staff = browser(people.staff)
    canary = {"name": "chat", "targets": "tiny-chat=90 tiny-chat-next=10"}
    assert staff.post("/app/ops/routes/", canary).status_code == 302
    api = APIClient()
    api.force_authenticate(people.staff)
    rollback = {"targets": [{"target": "tiny-chat", "weight": 100}]}
    assert api.put("/api/routes/chat/set/", rollback, format="json").status_code == 200
    assert (
        staff.post("/app/ops/routes/", {"name": "chat", "targets": "-", "clear": "1"}).status_code
        == 302
    )
    events = list(AuditEvent.objects.filter(tenant=None).order_by("id"))
    assert [(e.action, e.actor_label, e.target_label) for e in events] == [
        ("route.set", "operator", "chat"),
        ("route.set", "operator", "chat"),
        ("route.clear", "operator", "chat"),
    ]
    assert events[0].details == {
        "before": None,
        "after": [["tiny-chat", 90], ["tiny-chat-next", 10]],
    }
    assert events[1].details["before"] == [["tiny-chat", 90], ["tiny-chat-next", 10]]
    assert events[2].details == {"before": [["tiny-chat", 100]]}
    changes = staff.get("/app/ops/").content.decode().split('id="ops-changes"')[1]
    assert changes.count('data-action="route.') == 3


def test_a_batch_is_started_from_a_file_sent_in_the_dashboard(people: TenantPeople) -> None:
    """Stored as the Files API stores it and made as the Batch API makes it, for a key the
    member may use; every refusal named on the form, and nothing kept from it."""
    import orjson

    from batches.models import Batch, File
    from tenants.models import Tenant

    def key(name: str, by: User, scopes: list[str]) -> ApiKey:
        return api_key_create(tenant=people.tenant, name=name, created_by=by, scopes=scopes).api_key

    shared = key("nightly runner", people.owner, ["batch"])
    own = key("dev batches", people.developer, ["inference", "batch"])
    online = key("chat only", people.owner, ["inference"])
    gone = key("old runner", people.owner, ["batch"])
    api_key_revoke(api_key=gone, actor=people.owner)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]},
    }
    jsonl = orjson.dumps(line) + b"\n" + orjson.dumps({**line, "custom_id": "b"}) + b"\n"

    def send(client: Client, api_key: ApiKey, name: str = "in.jsonl", body: bytes = jsonl) -> Any:
        form = {
            "file": SimpleUploadedFile(name, body),
            "endpoint": "/v1/chat/completions",
            "api_key": str(api_key.pk),
            "description": "nightly eval",
        }
        return client.post("/app/t/acme/batches/", form)

    owner, developer = browser(people.owner), browser(people.developer)
    offered = owner.get("/app/t/acme/batches/").content.decode().split('id="batch-upload"')[1]
    assert "nightly runner" in offered and "dev batches" in offered
    assert "chat only" not in offered and "old runner" not in offered
    mine = developer.get("/app/t/acme/batches/").content.decode().split('id="batch-upload"')[1]
    assert "dev batches" in mine and "nightly runner" not in mine  # only the keys they made

    made = send(owner, shared)
    batch = Batch.objects.get()
    assert made.status_code == 302 and made["Location"] == f"/app/t/acme/batches/{batch.id}/"
    assert (batch.api_key, batch.metadata, batch.status) == (
        shared,
        {"description": "nightly eval"},
        "validating",
    )
    assert File.objects.get(id=batch.input_file_id).lines == 2
    assert send(developer, own).status_code == 302  # a developer, as a key they made
    assert Batch.objects.filter(api_key=own).count() == 1

    # Refused, with the reason, and nothing made or kept.
    borrowed = send(developer, shared)
    assert borrowed.status_code == 400 and "Select a valid choice" in borrowed.content.decode()
    assert send(owner, online).status_code == 400
    assert send(owner, gone).status_code == 400
    wrong = send(owner, shared, name="in.csv")
    assert wrong.status_code == 400 and "must be JSONL" in wrong.content.decode()
    empty = send(owner, shared, body=b"")
    assert empty.status_code == 400
    Tenant.objects.filter(pk=people.tenant.pk).update(max_open_batches=2)
    full = send(owner, shared)
    assert full.status_code == 400 and "its quota of open batches" in full.content.decode()
    assert Batch.objects.count() == 2 and File.objects.count() == 2
    viewer = browser(people.viewer)
    assert 'id="batch-upload"' not in viewer.get("/app/t/acme/batches/").content.decode()
    assert send(viewer, shared).status_code == 403
    assert send(browser(people.outsider), shared).status_code == 404
    assert Batch.objects.count() == 2 and File.objects.count() == 2


def test_a_batch_has_a_page_with_its_lines_by_state_and_first_errors(people: TenantPeople) -> None:
    from batches.models import Batch, Line

    key = api_key_create(tenant=people.tenant, name="b", created_by=people.owner).api_key
    batch = Batch.objects.create(
        tenant=people.tenant,
        api_key=key,
        input_file_id="file-in",
        endpoint="/v1/chat/completions",
        model="tiny-chat",
        status=Batch.Status.IN_PROGRESS,
        in_progress_at=timezone.now(),
        expires_at=timezone.now() + timedelta(hours=24),
    )
    refused = {"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}}
    states = ["done", "done", "failed", "pending", "running"]
    Line.objects.bulk_create(
        Line(
            batch=batch,
            number=i,
            custom_id=f"c{i}",
            body={},
            state=state,
            prompt_tokens=10 if state == "done" else 0,
            status_code=400 if state == "failed" else None,
            response=refused if state == "failed" else None,
        )
        for i, state in enumerate(states, start=1)
    )
    # Its cost so far: what its lines' records cost, kept on each line as it is stored.
    Line.objects.filter(batch=batch, number=1).update(cost_micros=1_800)
    Line.objects.filter(batch=batch, number=2).update(cost_micros=2_000)
    page = browser(people.viewer).get(f"/app/t/acme/batches/{batch.id}/").content.decode()
    assert "2 done, 1 failed of 5" in page and "20 in" in page
    assert "data-cost" not in page  # a viewer sees no money
    finance = browser(people.finance).get(f"/app/t/acme/batches/{batch.id}/").content.decode()
    assert "<td data-cost>$0.0038 " in finance
    fragment = browser(people.owner).get(f"/app/t/acme/batches/{batch.id}/?fragment=1")
    html = fragment.content.decode()
    assert html.startswith('<div id="batch-live" hx-get=') and "<html" not in html
    assert "$0.0038" in html
    for state, n in (("pending", 1), ("running", 1), ("done", 2), ("failed", 1), ("expired", 0)):
        assert f'<tr data-state="{state}"><th>{state}</th><td>{n}</td></tr>' in page
    assert "max_tokens is too large" in page and "<code>c3</code>" in page
    assert "/app/t/acme/files/file-in/" not in page  # a viewer reads, but downloads nothing
    owner_page = browser(people.owner).get(f"/app/t/acme/batches/{batch.id}/").content.decode()
    assert "/app/t/acme/files/file-in/" in owner_page
    listing = browser(people.viewer).get("/app/t/acme/batches/").content.decode()
    assert f'href="/app/t/acme/batches/{batch.id}/"' in listing
    outsider = browser(people.outsider)
    assert outsider.get(f"/app/t/acme/batches/{batch.id}/").status_code == 404
    assert outsider.get(f"/app/t/acme/batches/{batch.id}/?fragment=1").status_code == 404
    assert outsider.get(f"/app/t/globex/batches/{batch.id}/").status_code == 404  # its own slug
    assert browser(people.owner).get("/app/t/acme/batches/batch_nope/").status_code == 404
