"""The operator page's model routes (canaries) and its tenant table (paged, searchable)."""

from __future__ import annotations

import pytest

from inference.models import ModelRoute
from inference.services import model_ensure
from tenants.models import Tenant
from tests.conftest import TenantPeople
from tests.dashboard.test_views import browser

pytestmark = pytest.mark.django_db(transaction=True)


def _models() -> None:
    for name in ("tiny-chat", "tiny-chat-next"):
        model_ensure(name=name, served_name="tiny-chat", context_length=1024)


def test_staff_route_a_name_move_its_weights_and_remove_it(people: TenantPeople) -> None:
    _models()
    staff = browser(people.staff)
    made = staff.post(
        "/app/ops/routes/", {"name": "tiny-chat", "targets": "tiny-chat=90 tiny-chat-next=10"}
    )
    assert made.status_code == 302
    assert ModelRoute.objects.get(name="tiny-chat").targets == [
        ["tiny-chat", 90],
        ["tiny-chat-next", 10],
    ]
    page = staff.get("/app/ops/").content.decode()
    assert 'data-route="tiny-chat"' in page and "tiny-chat=90 tiny-chat-next=10" in page
    staff.post(
        "/app/ops/routes/", {"name": "tiny-chat", "targets": "tiny-chat=100 tiny-chat-next=0"}
    )
    assert ModelRoute.objects.get().targets == [["tiny-chat", 100], ["tiny-chat-next", 0]]
    staff.post("/app/ops/routes/", {"name": "tiny-chat", "targets": "-", "clear": "1"})
    assert not ModelRoute.objects.exists()


@pytest.mark.parametrize(
    ("targets", "says"),
    [("tiny-chat=ninety", "TARGET=WEIGHT"), ("nope=100", "nope: no such model"), ("", "required")],
)
def test_a_route_that_cannot_be_is_a_form_error(
    people: TenantPeople, targets: str, says: str
) -> None:
    _models()
    response = browser(people.staff).post(
        "/app/ops/routes/", {"name": "tiny-chat", "targets": targets}
    )
    assert response.status_code == 400
    assert says in response.content.decode()
    assert not ModelRoute.objects.exists()


@pytest.mark.parametrize("persona", ["owner", "admin", "outsider"])
def test_only_staff_may_route(people: TenantPeople, persona: str) -> None:
    _models()
    response = browser(people.user(persona)).post(
        "/app/ops/routes/", {"name": "tiny-chat", "targets": "tiny-chat-next=100"}
    )
    assert response.status_code == 404
    assert not ModelRoute.objects.exists()


def test_a_thousand_tenants_page_and_search(people: TenantPeople) -> None:
    Tenant.objects.bulk_create(Tenant(slug=f"t-{i:04}", name=f"Tenant {i}") for i in range(1000))
    staff = browser(people.staff)
    first = staff.get("/app/ops/").content.decode()
    assert first.count("Limits, weight, suspend") == 50
    assert "Page 1 of 21" in first and "t-0000" in first and "t-0049" not in first
    last = staff.get("/app/ops/?page=21").content.decode()
    assert "t-0998" in last and "t-0999" in last and "t-0000" not in last
    found = staff.get("/app/ops/?q=t-012").content.decode()
    assert found.count("Limits, weight, suspend") == 10 and "t-0125" in found
    assert "acme" not in found.split('id="ops-tenant-list"')[1]
    nothing = staff.get("/app/ops/?q=zzz&page=9").content.decode()
    assert "No tenant matches" in nothing
