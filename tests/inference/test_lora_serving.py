"""Tenants' LoRA adapters served through the gateway on the session's real vLLM CPU engine
with LoRA on, its pool holding one adapter at a time (``max_loras`` 1): uploaded through the
API, validated by the stack's Celery worker, loaded on demand, evicted and reloaded,
rediscovered, unloaded on delete — and nobody else's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis as redis_lib
from django.core.files.uploadedfile import SimpleUploadedFile

from adapters.models import Adapter
from adapters.services import adapter_local_dir
from devkit.adapters import TINY_CONFIG, config, lora_tensors, safetensors, scaled_weights
from fleet.models import Model, Pool
from inference.catalog import adapters_held_key, catalog_publish
from inference.services import replica_probe
from tenants.models import Role, Tenant
from tests.conftest import client_for
from tests.engines import ENGINE_HEADERS, Engine
from tests.factories import MembershipFactory, UserFactory
from tests.live import Stack, stack_start, wait_for
from tests.serving import World, world_rows

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

PROMPT = "Hello there"


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def lora_stack(serving_db_url: str, media: Path) -> Iterator[Stack]:
    # The stack's worker validates uploads into the same storage this process reads.
    stack = stack_start(
        serving_db_url, name="lora", extra_env={"INFERPLANE_MEDIA_ROOT": str(media)}
    )
    yield stack
    stack.stop()


class LoraWorld(World):
    def uploader(self, tenant: Tenant) -> Any:
        return client_for(
            MembershipFactory.create(
                tenant=tenant, role=Role.DEVELOPER, user=UserFactory.create()
            ).user
        )

    def adapter(self, tenant: Tenant, name: str, weights: bytes) -> Adapter:
        """Upload through the control API; the stack's Celery worker validates it."""
        response = self.uploader(tenant).post(
            f"/api/tenants/{tenant.slug}/adapters/upload/",
            {
                "name": name,
                "adapter_config": SimpleUploadedFile("adapter_config.json", config()),
                "adapter_model": SimpleUploadedFile("adapter_model.safetensors", weights),
            },
            format="multipart",
        )
        assert response.status_code == 202, response.content
        adapter: Adapter = wait_for(
            lambda: Adapter.objects.filter(
                tenant=tenant, name=name, status=Adapter.Status.READY
            ).first()
        )
        return adapter

    def models(self, key: str) -> set[str]:
        return {m.id for m in self.stack.openai(key).models.list()}

    def complete(self, key: str, model: str) -> str:
        reply = self.stack.openai(key).completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0
        )
        assert reply.model == model
        return reply.choices[0].text

    def engine_adapters(self) -> set[str]:
        listed = httpx.get(
            f"{self.engines[0].url}/v1/models", headers=ENGINE_HEADERS, timeout=10
        ).json()["data"]
        return {m["id"] for m in listed if m.get("parent")}

    def adapter_path(self, tenant: Tenant, name: str) -> str:
        return adapter_local_dir(adapter=Adapter.objects.get(tenant=tenant, name=name))

    def replica_key(self) -> str:
        replica = self.pool().replicas.get()
        return adapters_held_key("online", str(replica.pk))

    def loads(self) -> dict[str, int]:
        replica = self.pool().replicas.get()
        stats = redis_lib.Redis.from_url(self.stack.env["REDIS_URL"]).hgetall(
            "ip:{p:online}:lora_stats"
        )
        return {
            kind: int(stats.get(f"{replica.pk}|{kind}".encode(), 0))
            for kind in ("loads", "evictions")
        }


@pytest.fixture
def lora_world(
    transactional_db: None, lora_engine: Engine, lora_stack: Stack, media: Path, settings: Any
) -> LoraWorld:
    settings.MEDIA_ROOT = media
    world_rows([lora_engine])
    Model.objects.filter(name="tiny-chat").update(supports_lora=True, architecture=TINY_CONFIG)
    Pool.objects.filter(name="online").update(max_loras=1)
    catalog_publish()
    return LoraWorld(stack=lora_stack, engines=[lora_engine])


WEIGHTS = safetensors(lora_tensors())


def test_an_adapter_is_served_to_its_tenant_only(lora_world: LoraWorld) -> None:
    tenant, key = lora_world.tenant()
    _, other_key = lora_world.tenant()
    lora_world.adapter(tenant, "bot", WEIGHTS)
    address = f"{tenant.slug}/bot"
    wait_for(lambda: address in lora_world.models(key))
    assert {address, f"{address}:1", "tiny-chat"} <= lora_world.models(key)
    assert lora_world.models(other_key) == {"tiny-chat"}

    base = lora_world.complete(key, "tiny-chat")
    tuned = lora_world.complete(key, address)
    assert tuned != base  # the adapter is applied
    assert lora_world.complete(key, f"{address}:1") == tuned  # and stable, by version too
    # Another tenant, an unknown version, a made-up name: the same 404 as for any model.
    for caller, model in ((other_key, address), (key, f"{address}:7"), (key, "nobody/bot")):
        with pytest.raises(openai.NotFoundError) as caught:
            lora_world.complete(caller, model)
        assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        lora_world.stack.openai(other_key).models.retrieve(address)

    # Billed as the base model, grouped by adapter; the adapter shows when it was last used.
    records = wait_for(
        lambda: len(r := lora_world.records(tenant=tenant, status="ok")) == 3 and r, timeout=30
    )
    assert {(r.model, r.adapter) for r in records} == {("tiny-chat", ""), ("tiny-chat", "bot:1")}
    assert Adapter.objects.get(tenant=tenant, name="bot").last_used_at is not None
    staff = client_for(UserFactory.create(is_staff=True))

    def by_adapter() -> dict[str, int]:
        since = int(time.time()) - 86400
        answer = staff.get(
            f"/api/usage/?tenant={tenant.slug}&group_by=adapter&start_time={since}"
        ).json()
        results = [r for bucket in answer["data"] for r in bucket["results"]]
        return {r["adapter"]: r["num_model_requests"] for r in results}

    wait_for(lambda: by_adapter() == {"": 1, "bot:1": 2}, timeout=40)


def test_one_slot_evicts_the_least_recently_used_and_reloads_it(lora_world: LoraWorld) -> None:
    tenant, key = lora_world.tenant()
    lora_world.adapter(tenant, "one", WEIGHTS)
    lora_world.adapter(tenant, "two", safetensors(lora_tensors(), variant=1))
    one, two = f"{tenant.slug}/one", f"{tenant.slug}/two"
    wait_for(lambda: {one, two} <= lora_world.models(key))
    before = lora_world.loads()

    first = lora_world.complete(key, one)
    assert lora_world.engine_adapters() == {f"{one}:1"}
    second = lora_world.complete(key, two)  # the engine holds one: `one` is evicted
    assert lora_world.engine_adapters() == {f"{two}:1"}
    again = lora_world.complete(key, one)  # and loaded again
    assert lora_world.engine_adapters() == {f"{one}:1"}

    assert first != second and again == first
    after = lora_world.loads()
    assert after["loads"] - before["loads"] == 3
    assert after["evictions"] - before["evictions"] >= 2


def test_concurrent_first_requests_load_the_adapter_once(lora_world: LoraWorld) -> None:
    tenant, key = lora_world.tenant(max_concurrency=20)
    lora_world.adapter(tenant, "hot", scaled_weights(WEIGHTS, 2))
    address = f"{tenant.slug}/hot"
    wait_for(lambda: address in lora_world.models(key))
    before = lora_world.loads()
    texts: list[str] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            texts.append(lora_world.complete(key, address))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(texts) == 6 and len(set(texts)) == 1
    assert lora_world.loads()["loads"] - before["loads"] == 1


def test_an_engine_that_lost_its_adapters_gets_them_back(lora_world: LoraWorld) -> None:
    """An engine restart empties it: the router's record is corrected by the next request
    (the engine answers 404: load again, once) and by the health probe (rediscovery)."""
    tenant, key = lora_world.tenant()
    lora_world.adapter(tenant, "bot", WEIGHTS)
    address = f"{tenant.slug}/bot"
    wait_for(lambda: address in lora_world.models(key))
    expected = lora_world.complete(key, address)
    engine_url = lora_world.engines[0].url
    httpx.post(
        f"{engine_url}/v1/unload_lora_adapter",
        json={"lora_name": f"{address}:1"},
        headers=ENGINE_HEADERS,
    )
    assert lora_world.engine_adapters() == set()
    assert lora_world.complete(key, address) == expected
    assert lora_world.engine_adapters() == {f"{address}:1"}

    # The probe makes the router's record what the engine holds.
    held = redis_lib.Redis.from_url(lora_world.stack.env["REDIS_URL"])
    httpx.post(
        f"{engine_url}/v1/unload_lora_adapter",
        json={"lora_name": f"{address}:1"},
        headers=ENGINE_HEADERS,
    )
    replica_probe(replica=lora_world.pool().replicas.get())
    assert held.zrange(lora_world.replica_key(), 0, -1) == []
    # Loaded behind the router's back (as before a restart of ours): found by the probe.
    path = lora_world.adapter_path(tenant, "bot")
    httpx.post(
        f"{engine_url}/v1/load_lora_adapter",
        json={"lora_name": f"{address}:1", "lora_path": path},
        headers=ENGINE_HEADERS,
    ).raise_for_status()
    replica_probe(replica=lora_world.pool().replicas.get())
    assert held.zrange(lora_world.replica_key(), 0, -1) == [f"{address}:1".encode()]
    # One the engine holds but nobody may use (a delete that found the engine away): the
    # probe unloads it.
    httpx.post(
        f"{engine_url}/v1/load_lora_adapter",
        json={"lora_name": f"{address}:9", "lora_path": path},
        headers=ENGINE_HEADERS,
    ).raise_for_status()
    replica_probe(replica=lora_world.pool().replicas.get())
    assert lora_world.engine_adapters() == {f"{address}:1"}
    assert held.zrange(lora_world.replica_key(), 0, -1) == [f"{address}:1".encode()]


def test_deleting_an_adapter_unloads_it_and_removes_its_files(
    lora_world: LoraWorld, media: Path
) -> None:
    tenant, key = lora_world.tenant()
    adapter = lora_world.adapter(tenant, "gone", scaled_weights(WEIGHTS, 5))
    address = f"{tenant.slug}/gone"
    wait_for(lambda: address in lora_world.models(key))
    lora_world.complete(key, address)
    assert lora_world.engine_adapters() == {f"{address}:1"}
    files = media / "adapters" / adapter.sha256
    assert files.is_dir()

    owner = lora_world.uploader(tenant)
    deleted = owner.post(f"/api/tenants/{tenant.slug}/adapters/gone/1/delete/")
    assert deleted.status_code in (200, 204), deleted.content
    wait_for(lambda: address not in lora_world.models(key))
    with pytest.raises(openai.NotFoundError):
        lora_world.complete(key, address)
    wait_for(lambda: lora_world.engine_adapters() == set(), timeout=30)
    wait_for(lambda: not files.exists(), timeout=30)


def test_an_adapter_the_engine_refuses_fails_that_request_only(
    lora_world: LoraWorld, media: Path
) -> None:
    """Its weights were damaged behind our back: the engine refuses the load. The caller gets
    a clear 503; the replica stays in rotation for everyone else."""
    tenant, key = lora_world.tenant()
    adapter = lora_world.adapter(tenant, "lost", scaled_weights(WEIGHTS, 7))
    address = f"{tenant.slug}/lost"
    wait_for(lambda: address in lora_world.models(key))
    (media / "adapters" / adapter.sha256 / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(openai.APIStatusError) as caught:
        lora_world.complete(key, address)
    assert caught.value.status_code == 503 and caught.value.code == "adapter_load_failed"
    ready = redis_lib.Redis.from_url(lora_world.stack.env["REDIS_URL"]).hkeys(
        "ip:{p:online}:replicas"
    )
    assert str(lora_world.pool().replicas.get().pk).encode() in ready
    assert lora_world.complete(key, "tiny-chat")  # the base model is served as before
    # No request is left marked as using an adapter once it is over.
    client = redis_lib.Redis.from_url(lora_world.stack.env["REDIS_URL"])
    assert all(client.zcard(k) == 0 for k in client.keys("ip:{p:online}:lora_use:*"))
