"""Model routes (canaries): a public name split between targets by integer weight, set by
operators (manage.py model_route, the control API), followed by every web process within a
second, each request keeping its target; the ledger and the metrics name the target."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from django.core.exceptions import ValidationError
from django.db import transaction
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from billing.models import UsageRecord
from contract import Catalog
from fleet.models import Model, ModelRoute, Pool
from inference.catalog import catalog_build, catalog_publish
from inference.services import (
    model_ensure,
    model_route_clear,
    model_route_set,
    pool_ensure,
    replica_probe,
)
from tests.conftest import TenantPeople, client_for, run_manage
from tests.engines import Engine
from tests.live import wait_for
from tests.serving import World


def _models(*names: str, task: str = "generate") -> None:
    for name in names:
        model_ensure(name=name, served_name=name, context_length=1024, task=task)


# --- the split ----------------------------------------------------------------------------------


def test_a_route_splits_by_its_integer_weights() -> None:
    catalog = Catalog(version=1, models={}, pools={}, routes={"chat": [("a", 90), ("b", 10)]})
    draws = [i / 1000 for i in range(1000)]
    picked = Counter(catalog.route("chat", draw) for draw in draws)
    assert picked == {"a": 900, "b": 100}
    assert catalog.route("other", 0.5) == "other"  # not routed: itself
    rolled_back = Catalog(version=1, models={}, pools={}, routes={"chat": [("a", 100), ("b", 0)]})
    assert {rolled_back.route("chat", draw) for draw in draws} == {"a"}


@pytest.mark.django_db(transaction=True)
def test_a_routed_name_is_callable_as_its_heaviest_target_and_listed() -> None:
    _models("stable", "next")
    for pool, model in (("online", "stable"), ("online-next", "next")):
        pool_ensure(
            name=pool, kind="dedicated", model=Model.objects.get(name=model), replica_urls=[]
        )
    with transaction.atomic():
        model_route_set(name="chat", targets=[("stable", 90), ("next", 10)])
    catalog = catalog_build()
    found = catalog.callable("chat", tenant_id=1)
    assert found is not None and (found.name, found.base, found.pool) == (
        "chat",
        "stable",
        "online",
    )
    direct = catalog.callable("next", tenant_id=1, routed=False)
    assert direct is not None and direct.base == "next"
    assert {"chat", "stable", "next"} <= set(catalog.callable_by(1))


# --- setting routes -------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("name", "targets", "says"),
    [
        ("chat", [], "between 1 and 8"),
        ("chat", [("stable", 0), ("next", 0)], "above 0"),
        ("chat", [("stable", 90), ("stable", 10)], "once"),
        ("chat", [("stable", -1)], "whole number"),
        ("chat", [("missing", 100)], "missing: no such model"),
        ("chat", [("guard", 100)], "classification"),
        ("bad name!", [("stable", 100)], "not a model name"),
        ("acme/bot", [("acme/bot:9", 100)], "not a ready version"),
        ("acme/bot", [("stable", 100)], "not a ready version"),
    ],
)
def test_a_route_that_cannot_serve_is_refused_with_the_reason(
    name: str, targets: list[tuple[str, int]], says: str
) -> None:
    _models("stable", "next")
    _models("guard", task="classify")
    with pytest.raises(ValidationError) as refused:
        model_route_set(name=name, targets=targets)
    assert says in " ".join(refused.value.messages)
    assert not ModelRoute.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_command_sets_shows_rolls_back_and_clears_a_route() -> None:
    _models("stable", "next")
    made = run_manage("model_route", "chat", "stable=90", "next=10")
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "chat: stable=90 (90%)  next=10 (10%)"
    assert catalog_build().routes == {"chat": [("stable", 90), ("next", 10)]}
    back = run_manage("model_route", "chat", "stable=100", "next=0")
    assert back.stdout.strip() == "chat: stable=100 (100%)  next=0 (0%)"
    assert run_manage("model_route", "chat").stdout.strip() == back.stdout.strip()
    bad = run_manage("model_route", "chat", "stable=ninety")
    assert bad.returncode != 0 and "TARGET=WEIGHT" in bad.stderr and "Traceback" not in bad.stderr
    missing = run_manage("model_route", "chat", "nope=100")
    assert missing.returncode != 0 and "nope: no such model" in missing.stderr
    assert run_manage("model_route", "chat", "--clear").stdout.strip() == "chat: route removed"
    assert catalog_build().routes == {}


# --- control API (staff only) ---------------------------------------------------------------------


@pytest.mark.django_db
def test_staff_set_list_and_clear_routes(people: TenantPeople) -> None:
    _models("stable", "next")
    staff = client_for(people.staff)
    body = {"targets": [{"target": "stable", "weight": 90}, {"target": "next", "weight": 10}]}
    made = staff.put(reverse("inference:route-set", args=["chat"]), body, format="json")
    assert made.status_code == 200, made.content
    assert made.json()["targets"] == body["targets"]
    listed = staff.get(reverse("inference:route-list")).json()
    assert [(r["name"], r["targets"]) for r in listed] == [("chat", body["targets"])]
    bad = staff.put(
        reverse("inference:route-set", args=["chat"]),
        {"targets": [{"target": "nope", "weight": 5}]},
        format="json",
    )
    assert bad.status_code == 400 and "nope: no such model" in str(bad.json())
    negative = staff.put(
        reverse("inference:route-set", args=["chat"]),
        {"targets": [{"target": "stable", "weight": -5}]},
        format="json",
    )
    assert negative.status_code == 400 and "weight" in str(negative.json())
    assert staff.delete(reverse("inference:route-clear", args=["chat"])).status_code == 204
    assert staff.delete(reverse("inference:route-clear", args=["chat"])).status_code == 404
    assert not ModelRoute.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("persona", ["owner", "admin", "developer", "viewer", "outsider"])
def test_non_staff_cannot_see_or_move_routes(people: TenantPeople, persona: str) -> None:
    _models("stable", "next")
    with transaction.atomic():
        model_route_set(name="chat", targets=[("stable", 90), ("next", 10)])
    client = client_for(people.user(persona))
    assert client.get(reverse("inference:route-list")).status_code == 403
    body = {"targets": [{"target": "next", "weight": 100}]}
    moved = client.put(reverse("inference:route-set", args=["chat"]), body, format="json")
    assert moved.status_code == 403
    assert client.delete(reverse("inference:route-clear", args=["chat"])).status_code == 403
    assert ModelRoute.objects.get().targets == [["stable", 90], ["next", 10]]


@pytest.mark.django_db
def test_anonymous_callers_get_401_from_routes(api: Any) -> None:
    assert api.get(reverse("inference:route-list")).status_code == 401


# --- a canary on a live stack -------------------------------------------------------------------

BOUND_SIGMAS = 5  # a split outside mean +- 5 sigma happens once in 1.7 million runs


def _canary_rows(engine: Engine) -> None:
    """tiny-chat (its pool "online", from the world) and tiny-chat-next on a pool of its own,
    both on the test engine (the canary of a new model version, as far as routing goes)."""
    model = model_ensure(name="tiny-chat-next", served_name="tiny-chat", context_length=1024)
    pool = pool_ensure(name="online-next", kind="dedicated", model=model, replica_urls=[engine.url])
    for replica in pool.replicas.all():
        replica_probe(replica=replica)
    Pool.objects.filter(name__in=["online", "online-next"]).update(max_inflight=32)
    catalog_publish()


async def _send(
    client: httpx.AsyncClient, url: str, key: str, n: int, *, concurrency: int
) -> list[tuple[float, int, str]]:
    """n requests for "tiny-chat", ``concurrency`` at a time: (start, status, request id)."""
    gate = asyncio.Semaphore(concurrency)
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    async def one() -> tuple[float, int, str]:
        async with gate:
            started = time.time()
            response = await client.post(
                f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            return started, response.status_code, response.headers.get("x-request-id", "")

    return await asyncio.gather(*(one() for _ in range(n)))


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_a_ninety_ten_canary_splits_and_rolls_back_within_a_second(world: World) -> None:
    _canary_rows(world.engines[0])
    with transaction.atomic():
        model_route_set(name="tiny-chat", targets=[("tiny-chat", 90), ("tiny-chat-next", 10)])
    time.sleep(0.6)  # every web process is told of the catalog's new version at once
    _, key = world.tenant()
    url = world.stack.url

    async def split() -> list[tuple[float, int, str]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await _send(client, url, key, 2000, concurrency=24)

    sent = asyncio.run(split())
    assert Counter(status for _, status, _ in sent) == {200: 2000}
    wait_for(lambda: UsageRecord.objects.filter(route="tiny-chat").count() == 2000, timeout=60)
    served = Counter(UsageRecord.objects.filter(route="tiny-chat").values_list("model", flat=True))
    n, p = 2000, 0.1
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(served["tiny-chat-next"] - n * p) <= BOUND_SIGMAS * sigma, served
    assert served["tiny-chat"] + served["tiny-chat-next"] == n
    assert set(UsageRecord.objects.filter(route="tiny-chat").values_list("pool", flat=True)) == {
        "online",
        "online-next",
    }
    # The metrics name the target as the ledger does.
    scraped = world.stack.metrics().text
    counted: Counter[str] = Counter()
    for family in text_string_to_metric_families(scraped):
        for sample in family.samples:
            if sample.name == "inferplane_requests_total" and sample.labels["route"]:
                assert sample.labels["route"] == "tiny-chat"
                counted[sample.labels["target"]] += int(sample.value)
    assert counted == served

    # The rollback, while requests keep coming: none fails, and from a second after the
    # weights moved every request runs on the stable target.
    async def rollback() -> tuple[list[tuple[float, int, str]], float]:
        async with httpx.AsyncClient(timeout=60) as client:
            traffic = asyncio.ensure_future(_send(client, url, key, 600, concurrency=8))
            await asyncio.sleep(1.0)

            def move() -> float:
                with transaction.atomic():
                    model_route_set(
                        name="tiny-chat", targets=[("tiny-chat", 100), ("tiny-chat-next", 0)]
                    )
                return time.time()  # published: on commit, above

            moved = await asyncio.to_thread(move)
            return await traffic, moved

    during, moved_at = asyncio.run(rollback())
    assert Counter(status for _, status, _ in during) == {200: 600}
    later = [rid for started, _, rid in during if started >= moved_at + 1.0]
    earlier = [rid for started, _, rid in during if started < moved_at]
    assert len(later) > 50 and earlier, "the switch came too late or too early in the traffic"
    wait_for(lambda: UsageRecord.objects.filter(route="tiny-chat").count() == 2600, timeout=60)
    models = dict(
        UsageRecord.objects.filter(request_id__in=later).values_list("request_id", "model")
    )
    assert len(models) == len(later) and set(models.values()) == {"tiny-chat"}

    # Clearing the route: "tiny-chat" is the plain model again, unrouted in the ledger.
    with transaction.atomic():
        model_route_clear(name="tiny-chat")
    time.sleep(0.6)
    plain = asyncio.run(_plain(url, key))
    record = wait_for(lambda: UsageRecord.objects.filter(request_id=plain).first())
    assert (record.model, record.route, record.pool) == ("tiny-chat", "", "online")


async def _plain(url: str, key: str) -> str:
    async with httpx.AsyncClient(timeout=60) as client:
        ((_, status, rid),) = await _send(client, url, key, 1, concurrency=1)
    assert status == 200
    return rid
