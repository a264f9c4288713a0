"""The serving catalog on a live stack of two web processes, as ``make run`` starts them: a
change made through the services reaches every process within a second, told (they do not
poll), and an idle process asks Redis nothing between changes."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from controlplane.redis import redis_sync
from inference.services import model_ensure, pool_ensure
from tenants.services import api_key_create, tenant_create
from tests.live import wait_for

pytestmark = [pytest.mark.django_db(transaction=True)]

PROBES = 24  # fresh connections a round: the kernel spreads them over both processes


def _listed(url: str, key: str) -> list[set[str]]:
    def one(_: int) -> set[str]:
        response = httpx.get(
            f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10
        )
        assert response.status_code == 200, response.text
        return {m["id"] for m in response.json()["data"]}

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(PROBES)))


def _workers(parent: int) -> set[int]:
    """The processes uvicorn started (``scripts/web.sh`` execs uvicorn): its workers, and
    multiprocessing's resource tracker."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == parent:
                        found.add(int(entry))
            except OSError:
                continue
    return found


def _gateway_connections(pids: set[int]) -> list[dict[str, Any]]:
    return [
        c
        for c in redis_sync().client_list()
        if str(c.get("name", "")).startswith("inferplane-gateway-")
        and int(str(c["name"]).rpartition("-")[2]) in pids
    ]


def test_a_catalog_change_reaches_every_web_process_within_a_second(
    serving_db_url: str, stack_factory: Any
) -> None:
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    stack = stack_factory(serving_db_url, workers=2, name="catalog2", celery=False)
    tenant = tenant_create(slug="catalog-live", weight=1, limits={}, actor=None)
    key = api_key_create(tenant=tenant, name="test", created_by=None).secret
    wait_for(lambda: httpx.get(f"{stack.url}/healthz", timeout=2).status_code == 200, timeout=60)
    children = _workers(stack.processes["web"].pid)

    def serving() -> set[int]:
        return {int(str(c["name"]).rpartition("-")[2]) for c in _gateway_connections(children)}

    # Both processes hold the catalog (and their subscriptions) once each has answered.
    wait_for(
        lambda: (
            all("tiny-chat" in seen for seen in _listed(stack.url, key)) and len(serving()) == 2
        ),
        timeout=30,
    )
    pids = serving()
    # Idle: neither process sends Redis a command (the subscription just waits).
    time.sleep(3)
    quiet = [int(c["idle"]) for c in _gateway_connections(pids)]
    assert len(pids) >= 2 and quiet and min(quiet) >= 2, quiet

    new = model_ensure(name="tiny-next", served_name="/models/next", context_length=2048)
    pool_ensure(name="next", model=new, kind="dedicated", replica_urls=[])  # published
    changed = time.monotonic()
    # Every request sent once a second has passed is answered by a process that has it.
    time.sleep(max(0.0, changed + 1.0 - time.monotonic()))
    rounds = _listed(stack.url, key)
    assert all("tiny-next" in seen for seen in rounds), [len(seen) for seen in rounds]
