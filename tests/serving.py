"""A serving world for gateway tests: the tiny model, an online pool on real engines, a
live stack (module-scoped: every stack's Celery worker takes tasks from the one broker, so a
stack left running would take the tasks meant for another module's stack), and tenants with
keys.

These tests use ``transactional_db``: rows are committed, so the live processes see them,
and every table is emptied after each test. The world's rows are (re)created per test.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from billing.models import UsageRecord
from fleet.models import Model, Pool, Replica
from inference.catalog import catalog_applied, catalog_publish
from inference.services import model_ensure, pool_ensure, replica_probe
from moderation.publishing import policies_applied
from tenants.models import Tenant
from tenants.services import api_key_create, tenant_create
from tests.engines import Engine
from tests.live import Stack, stack_start

_slugs = itertools.count(1)


@dataclass
class World:
    stack: Stack
    engines: list[Engine]

    def tenant(self, *, weight: int = 1, **limits: int | None) -> tuple[Tenant, str]:
        """A tenant with the given limits and one API key; returns (tenant, key)."""
        tenant = tenant_create(
            slug=f"live-{next(_slugs)}", weight=weight, limits=limits, actor=None
        )
        issued = api_key_create(tenant=tenant, name="test", created_by=None)
        return tenant, issued.secret

    def records(self, **filters: Any) -> list[UsageRecord]:
        return list(UsageRecord.objects.filter(**filters).order_by("id"))

    def pool(self) -> Pool:
        return Pool.objects.get(name="online")


def world_rows(engines: list[Engine], **pool_settings: Any) -> None:
    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool = pool_ensure(
        name="online", kind="dedicated", model=model, replica_urls=[e.url for e in engines]
    )
    if pool_settings:
        Pool.objects.filter(pk=pool.pk).update(**pool_settings)
    for replica in pool.replicas.all():
        replica_probe(replica=replica)
    catalog_everywhere()


# A live process applies an announced catalog or policy change within milliseconds; a
# loaded machine's scheduler is given far longer (a process that never applies it fails).
APPLY_WITHIN = 30.0


def catalog_everywhere() -> None:
    """Publish the catalog (when the rows changed it) and wait until every live process
    holding a copy has applied the last one announced: a web process, a Celery worker's
    batch runner (one without a copy reads it on its first request)."""
    catalog_publish()
    catalog_applied(within=APPLY_WITHIN)


def policies_everywhere() -> None:
    """Wait until every live process holding the moderation policies has applied the last
    change (``policies_applied``): the change's own publish runs on commit."""
    policies_applied(within=APPLY_WITHIN)


def spot_pool(engines: list[Engine], **pool_settings: Any) -> Pool:
    """A spot pool (batch lines' pool) of the tiny model on ``engines``, probed ready (after
    ``world_rows``; the caller publishes the catalog)."""
    pool = pool_ensure(
        name="spot",
        kind="spot",
        model=Model.objects.get(name="tiny-chat"),
        replica_urls=[e.url for e in engines],
    )
    if pool_settings:
        Pool.objects.filter(pk=pool.pk).update(**pool_settings)
    for replica in pool.replicas.all():
        replica_probe(replica=replica)
    assert set(pool.replicas.values_list("state", flat=True)) == {Replica.State.READY}
    return pool


@pytest.fixture(scope="module")
def gateway_stack(serving_db_url: str) -> Iterator[Stack]:
    stack = stack_start(serving_db_url, name="gateway")
    yield stack
    stack.stop()


@pytest.fixture
def world(transactional_db: None, engine: Engine, gateway_stack: Stack) -> World:
    world_rows([engine])
    return World(stack=gateway_stack, engines=[engine])
