"""The operator page: model routes (canaries), its tenant table (paged, searchable), each
pool's last minutes and what it lends."""

from __future__ import annotations

import asyncio

import pytest
from django.template.loader import render_to_string

from controlplane.redis import redis_sync
from dashboard.selectors import _spark, ops_sparklines
from fleet.models import Model, ModelRoute, Replica
from inference.catalog import catalog_publish
from inference.gateway import metrics
from inference.gateway.admission import Admission
from inference.services import model_ensure, pool_configure, pool_ensure
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


def test_a_window_s_p95_is_the_bucket_that_holds_it() -> None:
    buckets = metrics.TIME_TO_FIRST_TOKEN_BUCKETS
    # 100 requests: 94 within 10 ms (bucket 2), 6 at 1 s (bucket 11): p95 is 1 s.
    counts = {"n": 100, "t2": 94, "t11": 6}
    assert metrics.spark_p95(counts, "t", buckets) == 1.0
    assert metrics.spark_p95({"n": 100, "t2": 96, "t11": 4}, "t", buckets) == 0.01
    assert metrics.spark_p95({}, "t", buckets) is None
    above = {"n": 1, f"t{len(buckets)}": 1}  # slower than every bucket: the last bound
    assert metrics.spark_p95(above, "t", buckets) == buckets[-1]


def test_a_sparkline_leaves_gaps_where_nothing_ran() -> None:
    line = _spark([0.5, 1.0, None, None, 0.25, 0.5], (0.1, 0.25, 0.5, 1.0))
    assert len(line["lines"]) == 2 and line["latest"] == 0.5 and line["top"] == 1.0
    assert line["latest_low"] == 0.25  # the latest p95 lies in (0.25, 0.5]
    assert _spark([None, None])["lines"] == [] and _spark([None])["latest"] is None
    # A window served between two idle ones is a dot: a one-point line would draw nothing.
    lonely = _spark([None, 0.25, None, 0.5, 0.5], (0.1, 0.25, 0.5))
    assert len(lonely["dots"]) == 1 and len(lonely["lines"]) == 1


def test_the_operator_page_draws_each_pool_s_last_minutes(people: TenantPeople) -> None:
    _models()
    pool_ensure(
        name="online",
        kind="dedicated",
        model=Model.objects.get(name="tiny-chat"),
        replica_urls=[],
    )
    now = 1_000_000.0
    window = int(now // metrics.SPARK_WINDOW_SECONDS)
    redis_sync().hset(metrics.spark_key("online", window - 1), mapping={"n": 4, "t9": 4, "w0": 4})
    redis_sync().hset(metrics.spark_key("online", window), mapping={"n": 2, "t11": 2, "w10": 2})
    spark = ops_sparklines(["online"], now=now)["online"]
    assert spark["served"] == 6
    assert spark["ttft"]["latest"] == 1.0 and spark["ttft"]["top"] == 1.0
    assert spark["wait"]["latest"] == metrics.QUEUE_WAIT_BUCKETS[10]
    page = browser(people.staff).get("/app/ops/").content.decode()
    assert 'data-spark="ttft"' in page and 'data-spark="wait"' in page
    drawn = render_to_string("dashboard/_spark.html", {"label": "TTFT", "spark": spark["ttft"]})
    assert "0.75 to 1 s" in drawn  # the bucket the p95 is in, not a number it is not


def test_the_operator_page_shows_what_a_pool_runs_online_and_what_it_lends(
    people: TenantPeople,
) -> None:
    """Two batch lines on lent room beside one online request, through admission itself."""
    _models()
    pool = pool_ensure(
        name="online",
        kind="dedicated",
        model=Model.objects.get(name="tiny-chat"),
        replica_urls=["http://gpu-a:8000"],
    )
    pool.replicas.update(state=Replica.State.READY)
    pool_configure(pool=pool, lend_percent=50)  # of 8 sequences: 4
    catalog_publish()
    staff = browser(people.staff)
    assert "data-lending" in staff.get("/app/ops/").content.decode()  # lends, nothing lent yet

    async def load() -> None:
        adm = Admission()
        for rid in ("line-1", "line-2"):
            assert await adm.borrow(
                pool="online", rid=rid, tenant=1, weight=1, prompt_estimate=5, prefix="",
                limit_keys=(),
            )  # fmt: skip
        await adm.admit(
            pool="online", rid="chat", tenant=2, weight=1, prompt_estimate=5, prefix="",
            wait_seconds=1, limit_keys=(),
        )  # fmt: skip

    asyncio.run(load())
    page = staff.get("/app/ops/?fragment=1").content.decode()
    lending = page.split("data-lending", 1)[1].split("</span>", 1)[0]
    assert "1 online, 2 lent of 4, 0 taken back" in lending
    pool_configure(pool=pool, lend_percent=0)
    assert "data-lending" not in staff.get("/app/ops/").content.decode()  # lends nothing now
