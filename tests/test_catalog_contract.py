"""The typed contract between the control plane and the gateway: who may call which model
(one decision, ``Catalog.callable``), which price is in force, and the catalog surviving the
trip through Redis whole — or being rebuilt when what Redis holds cannot be read."""

from __future__ import annotations

import asyncio
import threading
import time
from decimal import Decimal

import pytest
from django.db import connection
from redis.exceptions import RedisError

import inference.catalog
from adapters.models import Adapter
from contract import (
    AdapterVersion,
    Catalog,
    CatalogAdapter,
    CatalogModel,
    CatalogPool,
    PriceRow,
    catalog_decoder,
    encode,
    price_in_force,
)
from controlplane.redis import announced_keys, channel, redis_sync
from fleet.models import Model
from inference.catalog import (
    CATALOG_CHANNEL,
    CATALOG_DIGEST_KEY,
    CATALOG_KEY,
    CATALOG_TAG,
    CATALOG_VERSION_KEY,
    catalog_applied,
    catalog_build,
    catalog_publish,
    catalog_published,
)
from inference.gateway.catalog import CatalogView
from inference.gateway.watch import watches_end
from inference.services import model_ensure, pool_ensure
from tenants.models import Tenant
from tests.factories import TenantFactory
from tests.live import wait_for

ACME, GLOBEX = 1, 2


def _model(**fields: object) -> CatalogModel:
    values: dict[str, object] = {
        "served_name": "/models/m",
        "context_length": 2048,
        "supports_lora": True,
        "is_public": True,
        "allowed_tenants": frozenset(),
        "created": 100,
        "online_pool": "online",
    }
    values.update(fields)
    return CatalogModel(**values)  # type: ignore[arg-type]


def _catalog() -> Catalog:
    pool = CatalogPool(
        kind="dedicated",
        model="open",
        policy="vtc",
        max_inflight=8,
        max_queue_wait_seconds=5,
        replicas={},
    )
    return Catalog(
        version=1,
        models={
            "open": _model(),
            "private": _model(is_public=False, allowed_tenants=frozenset({GLOBEX})),
            "batch-only": _model(online_pool=None, batch_pool="spot"),
        },
        pools={"online": pool},
        adapters={
            "acme/bot": CatalogAdapter(
                tenant=ACME,
                created=200,
                latest=2,
                versions={
                    "1": AdapterVersion("acme/bot:1", "/a/1", "open"),
                    "2": AdapterVersion("acme/bot:2", "/a/2", "open"),
                },
            ),
            "acme/secret": CatalogAdapter(
                tenant=ACME,
                created=300,
                latest=1,
                versions={"1": AdapterVersion("acme/secret:1", "/s/1", "private")},
            ),
        },
    )


def test_a_tenant_calls_open_models_and_only_its_own_adapters() -> None:
    catalog = _catalog()
    assert list(catalog.callable_by(ACME)) == ["open", "acme/bot:1", "acme/bot", "acme/bot:2"]
    # Another tenant sees the model it is allowed, and none of acme's adapters.
    assert list(catalog.callable_by(GLOBEX)) == ["open", "private"]
    assert catalog.callable("acme/bot", GLOBEX) is None
    newest = catalog.callable("acme/bot", ACME)
    assert newest is not None and newest.adapter is not None
    assert (newest.base, newest.adapter.engine_name, newest.owned_by) == (
        "open",
        "acme/bot:2",
        "acme",
    )
    # An adapter on a model the tenant may not call is not callable either.
    assert catalog.callable("acme/secret", ACME) is None
    for unknown in ("acme/bot:", "acme/bot:7", "acme/nope", "nope"):
        assert catalog.callable(unknown, ACME) is None


def test_a_model_without_a_pool_of_the_kind_is_known_but_not_listed() -> None:
    catalog = _catalog()
    found = catalog.callable("batch-only", ACME)
    assert found is not None and found.pool is None  # the gateway answers 503 no_pool
    assert "batch-only" not in catalog.callable_by(ACME)
    assert list(catalog.callable_by(ACME, kind="batch")) == ["batch-only"]


def test_the_contract_price_wins_and_a_future_price_is_not_in_force() -> None:
    def row(starts: float, rate: str) -> PriceRow:
        return PriceRow(starts, Decimal(rate), Decimal(0), Decimal(rate), Decimal(50))

    prices = {
        "list": [row(10, "1"), row(100, "2")],
        f"tenant:{ACME}": [row(50, "0.5")],
    }
    assert price_in_force(prices, tenant_id=GLOBEX, at=99) == row(10, "1")
    assert price_in_force(prices, tenant_id=GLOBEX, at=100) == row(100, "2")
    assert price_in_force(prices, tenant_id=ACME, at=20) == row(10, "1")  # contract not yet
    assert price_in_force(prices, tenant_id=ACME, at=60) == row(50, "0.5")
    assert price_in_force(prices, tenant_id=ACME, at=5) is None


@pytest.mark.django_db
def test_the_published_catalog_reads_back_as_built() -> None:
    tenant = TenantFactory.create()
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    model.is_public = False
    model.save()
    model.allowed_tenants.add(tenant)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    built = catalog_publish()
    raw = redis_sync().get(CATALOG_KEY)
    assert isinstance(raw, bytes)
    read = catalog_decoder.decode(raw)
    assert read.models == built.models and read.pools == built.pools
    assert list(read.callable_by(tenant.pk)) == ["tiny-chat"]
    assert read.callable_by(tenant.pk + 1) == {}


@pytest.mark.django_db(transaction=True)
def test_a_gateway_rebuilds_a_catalog_it_cannot_read() -> None:
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    # What a publisher of another version (or a damaged key) might leave: valid JSON, wrong shape.
    redis_sync().set(CATALOG_KEY, encode({"version": 1, "models": {"tiny-chat": {}}, "pools": {}}))

    async def read() -> Catalog:
        view = CatalogView()
        await view.refresh()
        assert view.data is not None
        return view.data

    catalog = asyncio.run(read())
    assert catalog.models["tiny-chat"].online_pool == "online"
    raw = redis_sync().get(CATALOG_KEY)
    assert isinstance(raw, bytes)
    assert catalog_decoder.decode(raw).pools.keys() == catalog_build().pools.keys()


@pytest.mark.django_db(transaction=True)
def test_a_catalog_numbered_again_after_redis_lost_it_is_fetched() -> None:
    """Redis loses the catalog (a flush, a restart without persistence) and its counter
    starts again: a gateway holding another snapshot under the number the new one reaches
    fetches the new one (the digest differs), not keeps its own as if it were the same."""
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    catalog_publish()

    async def follow() -> tuple[object, object, int]:
        view = CatalogView()
        await view.refresh()
        held = view.version
        assert isinstance(held, bytes)
        await asyncio.to_thread(_lose_and_change, int(held))
        numbered = redis_sync().get(CATALOG_VERSION_KEY)
        assert isinstance(numbered, bytes)
        await view._look([numbered])  # the announcement of the new snapshot
        assert view.data is not None
        return held, numbered, view.data.models["tiny-chat"].context_length

    held, numbered, context = asyncio.run(follow())
    assert held == numbered  # the same number, another snapshot
    assert context == 4096


def _lose_and_change(reached: int) -> None:
    """Redis loses the catalog; the counter, started again, reaches ``reached`` with a
    changed snapshot (each change a publish of its own counts one)."""
    try:
        redis_sync().delete(CATALOG_VERSION_KEY, CATALOG_KEY, CATALOG_DIGEST_KEY)
        redis_sync().set(CATALOG_VERSION_KEY, reached - 1)
        Model.objects.filter(name="tiny-chat").update(context_length=4096)
        catalog_publish()
    finally:
        connection.close()  # this thread's own connection


def _add_model() -> None:
    try:
        model_ensure(name="tiny-next", served_name="/m/next", context_length=2048)
    finally:
        connection.close()  # this thread's own connection


@pytest.mark.django_db(transaction=True)
def test_gateways_fetch_the_catalog_only_when_it_changed() -> None:
    """A publish that changes nothing (a health probe round of a steady fleet) leaves the
    version alone; a change moves it, and a gateway's copy follows within half a second,
    told (a subscription): idle, it neither fetches nor even looks at the version."""
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    catalog_publish()
    version = redis_sync().get(CATALOG_VERSION_KEY)
    catalog_publish()
    catalog_publish()
    assert redis_sync().get(CATALOG_VERSION_KEY) == version

    async def follow() -> tuple[int, float]:
        view = CatalogView()
        looks = 0
        original = view._look

        async def counted(messages: list[bytes]) -> None:
            nonlocal looks
            looks += 1
            await original(messages)

        view._look = counted  # type: ignore[method-assign]
        await view.get()  # starts the background refresh: subscribes, looks once
        await asyncio.sleep(0.3)
        before = looks
        await asyncio.sleep(2)  # idle
        idle = looks - before
        await asyncio.to_thread(_add_model)  # published on commit
        changed = time.monotonic()
        for _ in range(200):
            if view.data is not None and "tiny-next" in view.data.models:
                break
            await asyncio.sleep(0.01)
        return idle, time.monotonic() - changed

    idle, seen_after = asyncio.run(follow())
    assert idle == 0
    assert seen_after < 0.5
    assert int(redis_sync().get(CATALOG_VERSION_KEY) or 0) == int(version or 0) + 1


def _adapter(tenant: Tenant, name: str, model: Model) -> None:
    try:
        Adapter.objects.create(
            tenant=tenant, name=name, version=1, status=Adapter.Status.READY, base_model=model
        )
        catalog_publish()  # what the adapter's validation does once it is ready
    finally:
        connection.close()  # when run in a thread: its own connection


@pytest.mark.django_db(transaction=True)
def test_each_tenant_fetches_its_own_adapters_and_only_when_they_changed() -> None:
    """The adapters are published per tenant, not in the snapshot: a gateway fetches a
    tenant's part when that tenant calls, and an upload by one tenant makes every gateway
    fetch that tenant's part again, and no one else's, and never the snapshot."""
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    Model.objects.filter(pk=model.pk).update(supports_lora=True)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    acme, globex = TenantFactory.create(slug="acme"), TenantFactory.create(slug="globex")
    _adapter(acme, "bot", model)
    _adapter(globex, "helper", model)
    snapshot = catalog_decoder.decode(redis_sync().get(CATALOG_KEY) or b"")
    assert snapshot.adapters == {}

    async def follow() -> tuple[list[str], list[str], bool, bool, int]:
        view = CatalogView()
        mine = await view.for_tenant(acme.pk)
        theirs = await view.for_tenant(globex.pk)
        seen = (sorted(mine.callable_by(acme.pk)), sorted(theirs.callable_by(globex.pk)))
        assert mine.callable("globex/helper", acme.pk) is None  # another's: unknown
        fetched = view.version
        await asyncio.to_thread(_adapter, acme, "writer", model)
        for _ in range(100):
            if "acme/writer" in (await view.for_tenant(acme.pk)).adapters:
                break
            await asyncio.sleep(0.01)
        globex_kept = view.merged.get(globex.pk) is theirs
        await asyncio.sleep(0.1)
        return *seen, globex_kept, view.version == fetched, len(view.parts[acme.pk])

    mine, theirs, globex_kept, snapshot_kept, acme_now = asyncio.run(follow())
    assert mine == ["acme/bot", "acme/bot:1", "tiny-chat"]
    assert theirs == ["globex/helper", "globex/helper:1", "tiny-chat"]
    assert acme_now == 2
    assert globex_kept and snapshot_kept


@pytest.mark.django_db(transaction=True)
def test_a_missed_announcement_of_adapters_drops_every_part() -> None:
    """A gap in the adapters' serial (a message lost while the subscription was away) makes
    the gateway fetch every tenant's part again rather than serve a stale one."""
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    acme = TenantFactory.create(slug="acme")
    _adapter(acme, "bot", model)

    async def gap() -> tuple[bool, bool]:
        view = CatalogView()
        await view.for_tenant(acme.pk)
        assert view.serial is not None
        await view._look([f"a:{view.serial + 2}:999".encode()])
        dropped = acme.pk not in view.parts
        await view.for_tenant(acme.pk)
        await view._look([f"a:{view.serial + 1}:999".encode()])
        return dropped, acme.pk in view.parts

    dropped, kept = asyncio.run(gap())
    assert dropped and kept


@pytest.mark.single_redis
@pytest.mark.django_db(transaction=True)
def test_a_deployment_in_another_redis_database_is_not_heard() -> None:
    """Pub/sub channels belong to the whole Redis server, not to a database: a publish of
    this deployment reaches a subscriber to its channel, and a deployment in another database
    of the same server (a staging stack, another group of make test) announces on another."""
    listener = redis_sync().pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
    listener.ssubscribe(channel(CATALOG_CHANNEL))
    db = redis_sync().connection_pool.connection_kwargs["db"]
    assert channel(CATALOG_CHANNEL) == f"{CATALOG_CHANNEL}:db{db}"
    try:
        # A deployment on database db+1 of the same server announces a change of its own.
        redis_sync().spublish(f"{CATALOG_CHANNEL}:db{db + 1}", "999")
        model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
        catalog_publish()
        message = wait_for(lambda: listener.get_message(timeout=1), timeout=10)
        assert message["channel"] == channel(CATALOG_CHANNEL).encode()  # the first one heard
        assert message["data"] != b"999"
    finally:
        listener.close()


@pytest.mark.django_db(transaction=True)
def test_a_publisher_waits_until_every_process_holding_a_copy_applied_it() -> None:
    """``catalog_applied`` (what the live tests wait on instead of a second's sleep): an
    announcement that reached two processes holding a copy is done once both applied it; one
    that has not (stuck in its look) is named in the error, not waited on forever; a process
    without a copy is not waited on (it reads the snapshot on its first request)."""
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    catalog_publish()
    assert catalog_applied(within=0) == 0  # announced before anyone held a copy

    async def follow() -> tuple[str, int, bool]:
        ready, stuck = CatalogView(), CatalogView()
        release = asyncio.Event()
        looked = [asyncio.Event(), asyncio.Event()]
        told = asyncio.Event()  # the ready one applied an announcement

        def watched(view: CatalogView, first: asyncio.Event, *, hold: bool) -> None:
            original = view._look

            async def look(messages: list[bytes]) -> None:
                if messages and hold:
                    await release.wait()
                await original(messages)
                first.set()  # its first look follows its subscription
                if messages and not hold:
                    told.set()

            view._look = look  # type: ignore[method-assign]

        watched(ready, looked[0], hold=False)
        watched(stuck, looked[1], hold=True)
        await ready.get()
        await stuck.get()
        await asyncio.gather(*(e.wait() for e in looked))
        await asyncio.to_thread(_add_model)  # published on commit: announced to both
        await told.wait()
        assert ready.data is not None and "tiny-next" in ready.data.models
        version = int(redis_sync().get(CATALOG_VERSION_KEY) or 0)
        counted = announced_keys(CATALOG_TAG, version)[1]
        # The ready one counts itself just after its look: then one of two have applied it.
        await asyncio.to_thread(wait_for, lambda: redis_sync().get(counted) == b"1")
        with pytest.raises(TimeoutError) as late:
            await asyncio.to_thread(catalog_applied, within=0.2)
        release.set()
        applied = await asyncio.to_thread(catalog_applied, within=10)
        assert stuck.data is not None
        return str(late.value), applied, "tiny-next" in stuck.data.models

    late, applied, stuck_has_it = asyncio.run(asyncio.wait_for(follow(), 30))
    version = int(redis_sync().get(CATALOG_VERSION_KEY) or 0)
    assert late == (
        f"1 of 2 processes applied the serving catalog's version {version} within 0.2 s"
    )
    assert applied == 2 and stuck_has_it


@pytest.mark.django_db(transaction=True)
def test_a_loop_that_stops_between_runs_is_not_listening_and_looks_when_it_runs_again() -> None:
    """The batch runner's loop runs only during a run: its watches end with each run
    (``watches_end``), so an announcement between runs reaches no one (it is not counted a
    listener that never applies), and the next run's first use of the catalog looks at the
    version first: the change made meanwhile is there."""
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    catalog_publish()
    loop = asyncio.new_event_loop()
    try:
        view = CatalogView()
        loop.run_until_complete(view.get())  # a run: its watch starts
        loop.run_until_complete(watches_end())  # the run ends
        assert view.task is not None and view.task.done()
        _add_model()  # between runs
        version = int(redis_sync().get(CATALOG_VERSION_KEY) or 0)
        assert redis_sync().get(announced_keys(CATALOG_TAG, version)[0]) == b"0"
        assert catalog_applied(within=0) == 0
        again = loop.run_until_complete(view.get())  # the next run
        assert "tiny-next" in again.models
        loop.run_until_complete(watches_end())
    finally:
        loop.close()


@pytest.mark.django_db(transaction=True)
def test_a_version_whose_look_failed_is_counted_once_a_later_look_succeeds() -> None:
    """A process told of a version whose look fails (Redis away a moment) applies it on the
    look that follows its next subscription, and counts itself then: a publisher waiting on
    ``catalog_applied`` is not left waiting for a process that did apply it."""
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    catalog_publish()

    async def follow() -> tuple[int, bool]:
        view, subscribed = CatalogView(), asyncio.Event()
        original, failed = view._look, list[list[bytes]]()

        async def look(messages: list[bytes]) -> None:
            if messages and not failed:
                failed.append(messages)
                raise RedisError("the look failed")  # the watch subscribes again, then looks
            await original(messages)
            subscribed.set()

        view._look = look  # type: ignore[method-assign]
        await view.get()
        await subscribed.wait()
        await asyncio.to_thread(_add_model)
        applied = await asyncio.to_thread(catalog_applied, within=20)
        return applied, view.data is not None and "tiny-next" in view.data.models

    applied, has_it = asyncio.run(asyncio.wait_for(follow(), 30))
    assert applied == 1 and has_it


@pytest.mark.django_db(transaction=True)
def test_a_publish_that_read_before_a_change_never_writes_over_the_changes_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two publishers at once: a health-probe round that read the database, then a change
    and its own publish (on commit) while the round still holds what it read. The round's
    older copy is never the last written: the change's publish waits for it, then reads."""
    model = model_ensure(name="tiny-chat", served_name="/models/tiny", context_length=2048)
    pool_ensure(name="online", model=model, kind="dedicated", replica_urls=[])
    catalog_publish()
    read, written = threading.Event(), threading.Event()
    build = inference.catalog.catalog_build

    def held_build() -> Catalog:
        built = build()
        if threading.current_thread().name == "round":
            read.set()
            written.wait(10)  # until the change's publish is done (or waits on the round)
        return built

    def round_() -> None:
        try:
            catalog_publish()
        finally:
            connection.close()  # this thread's own connection

    monkeypatch.setattr(inference.catalog, "catalog_build", held_build)
    probe = threading.Thread(target=round_, name="round")
    probe.start()
    assert read.wait(10)
    change = threading.Thread(target=_add_model)  # publishes on commit
    change.start()
    change.join(timeout=3)  # done already only if nothing made it wait
    written.set()
    probe.join(timeout=30)
    change.join(timeout=30)
    published = catalog_published()
    assert published is not None and "tiny-next" in published.models
