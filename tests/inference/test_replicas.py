"""Replicas: health probes against a real vLLM CPU engine, DNS discovery against a real DNS
server (dnslib) whose records the tests change, and the staff-only control API.

Most discovered addresses have nobody listening (127.0.0.x on a free port): their probes
fail at once and they are ``down``, which is all registration needs.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import orjson
import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.urls import reverse
from django.utils import timezone
from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from controlplane.redis import redis_sync
from fleet.models import Pool, Replica
from inference.catalog import CATALOG_KEY, catalog_publish, pool_prefix
from inference.gateway.admission import W_OUT, Admission
from inference.services import (
    model_ensure,
    pool_configure,
    pool_ensure,
    replica_add,
    replica_probe,
)
from inference.tasks import replicas_probe_all
from tests.conftest import TenantPeople, client_for
from tests.engines import Engine, free_port

# Committed rows: what the services do after the commit (publishing the catalog, clearing a
# removed replica's admission state) happens as in production.
pytestmark = pytest.mark.django_db(transaction=True)
SERVICE = "vllm-online.inferplane.test"


def _replica(url: str, served_name: str = "tiny-chat") -> Replica:
    model = model_ensure(name="tiny-chat", served_name=served_name, context_length=1024)
    pool = pool_ensure(name="online", kind="dedicated", model=model, replica_urls=[url])
    return pool.replicas.get()


# --- probes (real engine) ----------------------------------------------------------------------


@pytest.mark.engine
def test_a_live_engine_is_marked_ready(engine: Engine) -> None:
    replica = replica_probe(replica=_replica(engine.url))
    assert replica.state == Replica.State.READY
    assert replica.last_error == "" and replica.last_probe_at is not None


@pytest.mark.engine
def test_an_engine_that_does_not_answer_is_marked_down(engine: Engine) -> None:
    replica = _replica(engine.url)
    replica_probe(replica=replica)
    replica.url = f"http://127.0.0.1:{free_port()}"
    replica.save()
    replica = replica_probe(replica=replica, timeout=1)
    assert replica.state == Replica.State.DOWN
    assert "ConnectError" in replica.last_error


@pytest.mark.engine
def test_an_engine_serving_another_model_is_marked_down(engine: Engine) -> None:
    replica = replica_probe(replica=_replica(engine.url, served_name="llama-70b"))
    assert replica.state == Replica.State.DOWN
    assert "does not serve 'llama-70b'" in replica.last_error


@pytest.mark.engine
def test_a_draining_replica_stays_draining(engine: Engine) -> None:
    replica = _replica(engine.url)
    replica.state = Replica.State.DRAINING
    replica.save()
    assert replica_probe(replica=replica).state == Replica.State.DRAINING


def test_a_replica_drained_while_its_probe_runs_stays_draining() -> None:
    stale = _replica(f"http://127.0.0.1:{free_port()}")  # the probe round's copy
    Replica.objects.filter(pk=stale.pk).update(state=Replica.State.DRAINING)  # meanwhile
    probed = replica_probe(replica=stale, timeout=1)
    assert probed.state == Replica.State.DRAINING
    stale.refresh_from_db()
    assert stale.state == Replica.State.DRAINING and "ConnectError" in stale.last_error


def test_probing_a_replica_removed_meanwhile_writes_nothing() -> None:
    stale = _replica(f"http://127.0.0.1:{free_port()}")
    Replica.objects.filter(pk=stale.pk).delete()
    replica_probe(replica=stale, timeout=1)  # no error, no row brought back
    assert not Replica.objects.exists()


# --- a real DNS server -------------------------------------------------------------------------


@dataclass
class Zone(BaseResolver):
    """The records the DNS server answers with; tests change them between probe rounds."""

    records: dict[str, list[str]] = field(default_factory=dict)
    servfail: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, name: str, *addresses: str) -> None:
        with self.lock:
            self.records[name.rstrip(".")] = list(addresses)

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        with self.lock:
            if self.servfail:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            addresses = self.records.get(name)
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for address in addresses:
            if request.q.qtype == QTYPE.A and ":" not in address:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=5))
            elif request.q.qtype == QTYPE.AAAA and ":" in address:
                reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(address), ttl=5))
        return reply


@pytest.fixture
def zone(settings: Any) -> Iterator[Zone]:
    zone = Zone()
    quiet = DNSLogger("-recv,-send,-request,-reply,-truncated,-error,-data", prefix=False)
    server = DNSServer(zone, address="127.0.0.1", port=0, logger=quiet)
    server.start_thread()
    host, port = server.server.server_address
    settings.INFERPLANE_DNS_NAMESERVER = f"{host}:{port}"
    settings.INFERPLANE_PROBE_TIMEOUT_SECONDS = 1
    yield zone
    server.stop()


@pytest.fixture
def dns_pool(zone: Zone) -> Pool:
    """Pool "online" discovering its replicas at SERVICE, on a port nobody listens on."""
    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool = pool_ensure(
        name="online",
        kind="dedicated",
        model=model,
        replica_urls=[],
        discovery=f"http://{SERVICE}:{free_port()}",
    )
    assert pool.discovery == Pool.Discovery.DNS
    return pool


def _replicas(pool: Pool) -> dict[str, Replica]:
    return {r.url: r for r in Replica.objects.filter(pool=pool)}


def _catalog_replicas() -> dict[str, dict[str, str]]:
    raw = redis_sync().get(CATALOG_KEY)
    assert raw is not None
    replicas: dict[str, dict[str, str]] = orjson.loads(raw)["pools"]["online"]["replicas"]
    return replicas


def _url(pool: Pool, address: str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{pool.dns_port}"


# --- discovery ---------------------------------------------------------------------------------


def test_a_new_dns_address_becomes_a_probed_replica_with_a_name(zone: Zone, dns_pool: Pool) -> None:
    zone.set(SERVICE, "127.0.0.2", "::1")
    replicas_probe_all()

    replicas = _replicas(dns_pool)
    assert set(replicas) == {_url(dns_pool, "127.0.0.2"), _url(dns_pool, "::1")}
    for replica in replicas.values():
        assert replica.discovered
        assert replica.state == Replica.State.DOWN  # probed: nobody listens there
        assert replica.last_probe_at is not None and replica.last_error
    assert sorted(r.name for r in replicas.values()) == ["online-1", "online-2"]
    # The serving catalog carries the name, which is what tenants may be shown.
    assert {(r["url"], r["name"]) for r in _catalog_replicas().values()} == {
        (r.url, r.name) for r in replicas.values()
    }

    zone.set(SERVICE, "127.0.0.2", "::1", "127.0.0.3")
    replicas_probe_all()
    third = _replicas(dns_pool)[_url(dns_pool, "127.0.0.3")]
    assert third.name == "online-3" and third.discovered


def test_a_vanished_address_drains_and_is_removed_once_idle(zone: Zone, dns_pool: Pool) -> None:
    zone.set(SERVICE, "127.0.0.2", "127.0.0.3")
    replicas_probe_all()
    leaving = _replicas(dns_pool)[_url(dns_pool, "127.0.0.3")]
    # A request runs on it: the admission state counts it (the gateway's own scripts).
    Replica.objects.filter(pk=leaving.pk).update(state=Replica.State.READY)
    catalog_publish()
    adm = Admission()

    async def admit() -> str:
        try:
            return await adm.admit(
                pool="online",
                rid="r1",
                tenant=1,
                weight=1,
                prompt_estimate=10,
                prefix="",
                wait_seconds=5,
                limit_keys=(),
            )
        finally:
            for task in [*adm.listeners.values(), adm.renewer]:
                if task is not None:
                    task.cancel()

    assert asyncio.run(admit()) == str(leaving.pk)
    assert redis_sync().hget(pool_prefix("online") + "rload", str(leaving.pk)) == b"1"

    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    leaving.refresh_from_db()
    assert leaving.state == Replica.State.DRAINING and leaving.vanished_at is not None
    assert _catalog_replicas()[str(leaving.pk)]["state"] == "draining"
    assert str(leaving.pk).encode() not in redis_sync().hkeys(pool_prefix("online") + "replicas")

    replicas_probe_all()  # still running a request: it stays
    assert Replica.objects.filter(pk=leaving.pk).exists()

    async def complete() -> None:
        await Admission().complete(pool="online", rid="r1", adjustment=W_OUT * 5)

    asyncio.run(complete())
    replicas_probe_all()
    assert not Replica.objects.filter(pk=leaving.pk).exists()
    assert str(leaving.pk) not in _catalog_replicas()
    assert set(_replicas(dns_pool)) == {_url(dns_pool, "127.0.0.2")}


def test_a_vanished_replica_is_removed_after_the_grace_even_if_busy(
    zone: Zone, dns_pool: Pool
) -> None:
    zone.set(SERVICE, "127.0.0.2", "127.0.0.3")
    replicas_probe_all()
    leaving = _replicas(dns_pool)[_url(dns_pool, "127.0.0.3")]
    # A gateway that crashed mid-request leaves its count behind until its lease is reaped.
    redis_sync().hset(pool_prefix("online") + "rload", str(leaving.pk), 3)
    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    replicas_probe_all()
    assert Replica.objects.filter(pk=leaving.pk).exists()
    past = timezone.now() - timedelta(seconds=dns_pool.drain_grace_seconds + 1)
    Replica.objects.filter(pk=leaving.pk).update(vanished_at=past)
    replicas_probe_all()
    assert not Replica.objects.filter(pk=leaving.pk).exists()
    assert redis_sync().hget(pool_prefix("online") + "rload", str(leaving.pk)) is None


def test_a_dns_failure_keeps_every_replica(zone: Zone, dns_pool: Pool) -> None:
    zone.set(SERVICE, "127.0.0.2", "127.0.0.3")
    replicas_probe_all()
    before = {url: r.state for url, r in _replicas(dns_pool).items()}

    zone.servfail = True
    replicas_probe_all()
    replicas_probe_all()
    after = _replicas(dns_pool)
    assert {url: r.state for url, r in after.items()} == before
    assert all(r.vanished_at is None for r in after.values())
    dns_pool.refresh_from_db()
    assert "SERVFAIL" in dns_pool.discovery_error or "NoNameservers" in dns_pool.discovery_error

    zone.servfail = False
    replicas_probe_all()
    dns_pool.refresh_from_db()
    assert dns_pool.discovery_error == ""
    assert set(_replicas(dns_pool)) == set(before)


def test_an_unreachable_dns_server_keeps_every_replica(
    zone: Zone, dns_pool: Pool, settings: Any
) -> None:
    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    settings.INFERPLANE_DNS_NAMESERVER = f"127.0.0.1:{free_port()}"  # nobody answers
    replicas_probe_all()
    (replica,) = _replicas(dns_pool).values()
    assert replica.vanished_at is None and replica.state == Replica.State.DOWN
    dns_pool.refresh_from_db()
    assert dns_pool.discovery_error


def test_a_name_without_addresses_empties_the_pool(zone: Zone, dns_pool: Pool) -> None:
    """NXDOMAIN is an answer, not a failure: what a Service scaled to zero gives."""
    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    zone.records.clear()
    replicas_probe_all()
    (replica,) = _replicas(dns_pool).values()
    assert replica.state == Replica.State.DRAINING
    replicas_probe_all()
    assert _replicas(dns_pool) == {}


def test_a_returning_address_is_probed_again(zone: Zone, dns_pool: Pool) -> None:
    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    zone.set(SERVICE)
    replicas_probe_all()
    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    (replica,) = _replicas(dns_pool).values()
    assert replica.vanished_at is None and replica.name == "online-1"
    assert replica.state == Replica.State.DOWN  # probed like a new one, not left draining


def test_discovery_leaves_hand_registered_replicas_alone(zone: Zone, dns_pool: Pool) -> None:
    manual = replica_add(pool=dns_pool, url="http://canary.inferplane.test:8000")
    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    zone.set(SERVICE)
    replicas_probe_all()
    replicas_probe_all()
    manual.refresh_from_db()
    assert manual.vanished_at is None and not manual.discovered
    assert set(_replicas(dns_pool)) == {manual.url}


def test_switching_a_pool_back_to_static_stops_discovery(zone: Zone, dns_pool: Pool) -> None:
    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    pool_configure(pool=dns_pool, discovery="static")
    zone.set(SERVICE)
    replicas_probe_all()
    (replica,) = _replicas(dns_pool).values()
    assert replica.vanished_at is None


@pytest.mark.engine
async def test_a_discovered_engine_becomes_ready_and_takes_requests(
    zone: Zone, engine: Engine
) -> None:
    zone.set(SERVICE, "127.0.0.1")

    @sync_to_async
    def discover() -> Replica:
        try:
            model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
            pool = pool_ensure(
                name="online",
                kind="dedicated",
                model=model,
                replica_urls=[],
                discovery=f"http://{SERVICE}:{engine.port}",
            )
            replicas_probe_all()
            return Replica.objects.get(pool=pool)
        finally:
            connections.close_all()  # this thread's, or the test database cannot be dropped

    replica = await discover()
    assert (replica.url, replica.state) == (engine.url, Replica.State.READY)
    adm = Admission()
    try:
        chosen = await adm.admit(
            pool="online",
            rid=uuid.uuid4().hex,
            tenant=1,
            weight=1,
            prompt_estimate=10,
            prefix="",
            wait_seconds=5,
            limit_keys=(),
        )
    finally:
        for task in [*adm.listeners.values(), adm.renewer]:
            if task is not None:
                task.cancel()
    assert chosen == str(replica.pk)


# --- control API (staff only) ------------------------------------------------------------------


@pytest.fixture
def static_pool() -> Pool:
    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    return pool_ensure(
        name="online", kind="dedicated", model=model, replica_urls=["http://gpu-a:8000"]
    )


def _replica_url(name: str, pool: str, replica: Replica) -> str:
    return reverse(f"inference:{name}", kwargs={"pool": pool, "replica_id": replica.pk})


def test_staff_list_pools_with_their_replicas(people: TenantPeople, static_pool: Pool) -> None:
    response = client_for(people.staff).get(reverse("inference:pool-list"))
    assert response.status_code == 200, response.content
    (pool,) = response.json()
    assert pool["name"] == "online" and pool["discovery"] == "static"
    (replica,) = pool["replicas"]
    assert replica["name"] == "online-1" and replica["url"] == "http://gpu-a:8000"
    assert replica["in_flight"] == 0
    detail = client_for(people.staff).get(reverse("inference:pool-detail", args=["online"]))
    assert detail.json()["replicas"] == pool["replicas"]
    missing = client_for(people.staff).get(reverse("inference:pool-detail", args=["nope"]))
    assert missing.status_code == 404


@pytest.mark.parametrize("persona", ["owner", "admin", "developer", "viewer", "outsider"])
def test_non_staff_get_403_from_every_pool_endpoint(
    people: TenantPeople, static_pool: Pool, persona: str
) -> None:
    client = client_for(people.user(persona))
    replica = static_pool.replicas.get()
    assert client.get(reverse("inference:pool-list")).status_code == 403
    assert client.get(reverse("inference:pool-detail", args=["online"])).status_code == 403
    create = reverse("inference:replica-create", args=["online"])
    assert client.post(create, {"url": "http://gpu-b:8000"}).status_code == 403
    for name in ("replica-drain", "replica-ready", "replica-remove"):
        response = client.post(_replica_url(name, "online", replica), {}, format="json")
        assert response.status_code == 403, name
        assert "gpu-a" not in response.content.decode()
    replica.refresh_from_db()
    assert replica.state == Replica.State.DOWN
    assert list(Replica.objects.values_list("url", flat=True)) == ["http://gpu-a:8000"]


def test_anonymous_callers_get_401(api: Any, static_pool: Pool) -> None:
    assert api.get(reverse("inference:pool-list")).status_code == 401


def test_staff_add_drain_ready_and_remove_a_replica(
    people: TenantPeople, static_pool: Pool
) -> None:
    staff = client_for(people.staff)
    created = staff.post(
        reverse("inference:replica-create", args=["online"]),
        {"url": f"http://127.0.0.1:{free_port()}/"},
        format="json",
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["name"] == "online-2" and body["state"] == "down"
    replica = Replica.objects.get(pk=body["id"])
    assert str(replica.pk) in _catalog_replicas()

    drained = staff.post(_replica_url("replica-drain", "online", replica))
    assert drained.status_code == 200 and drained.json()["state"] == "draining"
    ready = staff.post(_replica_url("replica-ready", "online", replica))
    assert ready.status_code == 200
    # Probed at once: nobody listens there, so it is down rather than ready.
    assert ready.json()["state"] == "down" and ready.json()["last_error"]

    redis_sync().hset(pool_prefix("online") + "rload", str(replica.pk), 2)
    refused = staff.post(_replica_url("replica-remove", "online", replica), {}, format="json")
    assert refused.status_code == 400
    assert "2 request(s) in flight" in refused.json()["replica"][0]
    assert Replica.objects.filter(pk=replica.pk).exists()
    forced = staff.post(
        _replica_url("replica-remove", "online", replica), {"force": True}, format="json"
    )
    assert forced.status_code == 200
    assert forced.json() == {"removed": "online-2", "in_flight": 2}
    assert not Replica.objects.filter(pk=replica.pk).exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "gpu-b:8000"}, "url"),
        ({"url": "ftp://gpu-b"}, "url"),
        ({"url": "http://gpu-a:8000"}, "url"),  # already a replica
        ({"url": "http://gpu-b:8000", "name": "online-1"}, "name"),  # name taken
        ({"url": "http://gpu-b:8000", "name": "no spaces"}, "name"),
        ({}, "url"),
    ],
)
def test_bad_replica_input_gets_400(
    people: TenantPeople, static_pool: Pool, body: dict[str, str], field: str
) -> None:
    response = client_for(people.staff).post(
        reverse("inference:replica-create", args=["online"]), body, format="json"
    )
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert Replica.objects.count() == 1


def test_replica_ids_of_another_pool_are_404(people: TenantPeople, static_pool: Pool) -> None:
    other = pool_ensure(
        name="batch", kind="spot", model=static_pool.model, replica_urls=["http://gpu-z:8000"]
    )
    replica = other.replicas.get()
    response = client_for(people.staff).post(_replica_url("replica-drain", "online", replica))
    assert response.status_code == 404
    replica.refresh_from_db()
    assert replica.state == Replica.State.DOWN


# --- where operators see replicas ---------------------------------------------------------------


def test_the_operator_page_shows_names_and_the_last_dns_error(
    zone: Zone, dns_pool: Pool, people: TenantPeople
) -> None:
    from django.test import Client

    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    zone.servfail = True
    replicas_probe_all()
    client = Client()
    client.force_login(people.staff)
    page = client.get(reverse("dashboard:ops"), {"fragment": "1"}).content.decode()
    assert 'data-name class="nowrap">online-1' in page
    assert f"replicas: http://{SERVICE}:{dns_pool.dns_port}" in page
    assert "DNS discovery failed, replicas kept as they were" in page


def test_the_admin_names_a_replica_added_without_one(static_pool: Pool) -> None:
    from django.test import Client

    from tenants.models import User

    admin = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(admin)
    response = client.post(
        reverse("admin:fleet_replica_add"),
        {"pool": static_pool.pk, "name": "", "url": "http://vllm-online:8000", "state": "down"},
    )
    assert response.status_code == 302, response.context["adminform"].form.errors
    assert Replica.objects.get(url="http://vllm-online:8000").name == "online-2"
    # A single-label host (Compose, Kubernetes) is a valid engine URL; a bare host:port not.
    response = client.post(
        reverse("admin:fleet_replica_add"),
        {"pool": static_pool.pk, "name": "", "url": "vllm-batch:8000", "state": "down"},
    )
    assert response.status_code == 200 and "is not an engine URL" in response.content.decode()
    assert str(Replica.objects.get(url="http://vllm-online:8000").pk) in _catalog_replicas()


def test_the_pool_admin_names_inline_replicas_and_sets_dns_discovery(static_pool: Pool) -> None:
    from django.test import Client

    from tenants.models import User

    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    existing = static_pool.replicas.get()
    form = {
        "name": "online",
        "kind": "dedicated",
        "model": static_pool.model_id,
        "max_inflight": 8,
        "policy": "vtc",
        "max_queue_wait_seconds": 30,
        "max_lora_rank": 8,
        "max_loras": 4,
        "discovery": "dns",
        "dns_name": SERVICE,
        "dns_port": 8000,
        "dns_scheme": "http",
        "drain_grace_seconds": 60,
        "lend_percent": 0,
        "replicas-TOTAL_FORMS": 3,
        "replicas-INITIAL_FORMS": 1,
        "replicas-MIN_NUM_FORMS": 0,
        "replicas-MAX_NUM_FORMS": 1000,
        "replicas-0-id": existing.pk,
        "replicas-0-pool": static_pool.pk,
        "replicas-0-name": "gpu-a",  # renamed by the operator
        "replicas-0-url": existing.url,
        "replicas-0-state": "down",
        "replicas-1-pool": static_pool.pk,
        "replicas-1-name": "",
        "replicas-1-url": "http://gpu-b:8000",
        "replicas-1-state": "down",
        "replicas-2-pool": static_pool.pk,
        "replicas-2-name": "",
        "replicas-2-url": "http://gpu-c:8000",
        "replicas-2-state": "down",
    }
    response = client.post(reverse("admin:fleet_pool_change", args=[static_pool.pk]), form)
    assert response.status_code == 302, response.content.decode()[-3000:]
    names = dict(Replica.objects.values_list("url", "name"))
    assert names == {
        "http://gpu-a:8000": "gpu-a",
        "http://gpu-b:8000": "online-2",
        "http://gpu-c:8000": "online-3",
    }
    static_pool.refresh_from_db()
    assert static_pool.discovery_url == f"http://{SERVICE}:8000"
    assert {r["name"] for r in _catalog_replicas().values()} == set(names.values())

    response = client.post(
        reverse("admin:fleet_pool_change", args=[static_pool.pk]),
        {**form, "dns_name": "", "replicas-TOTAL_FORMS": 0, "replicas-INITIAL_FORMS": 0},
    )
    assert response.status_code == 200
    assert "DNS discovery needs the Service" in response.content.decode()


def test_seeding_a_dns_pool_keeps_its_discovered_replicas(zone: Zone, dns_pool: Pool) -> None:
    zone.set(SERVICE, "127.0.0.2")
    replicas_probe_all()
    again = pool_ensure(
        name="online",
        kind="dedicated",
        model=dns_pool.model,
        replica_urls=["http://canary:8000"],
        discovery=dns_pool.discovery_url,
    )
    assert set(_replicas(again)) == {_url(dns_pool, "127.0.0.2"), "http://canary:8000"}
    # Back to static with a URL list: the pool is exactly that list again.
    pool_ensure(
        name="online",
        kind="dedicated",
        model=dns_pool.model,
        replica_urls=["http://gpu-a:8000"],
        discovery="static",
    )
    assert set(_replicas(again)) == {"http://gpu-a:8000"}
