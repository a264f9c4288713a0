"""A validated adapter is one a real vLLM CPU engine accepts and applies: loaded from where
validation stored it, its greedy output differs from the base model's and is stable."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from adapters.services import adapter_local_dir, adapter_validate
from devkit.adapters import config, lora_tensors, safetensors, scaled_weights
from tenants.models import Adapter
from tests.adapters.test_adapters import served  # noqa: F401  (fixture)
from tests.conftest import TenantPeople, client_for
from tests.engines import ENGINE_HEADERS, Engine, engine_start


@pytest.fixture(scope="module")
def lora_engine() -> Iterator[Engine]:
    started = engine_start("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
    started.wait_ready()
    yield started
    started.stop()


def _greedy(engine: Engine, model: str) -> str:
    response = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": model, "prompt": "Hello there", "max_tokens": 12, "temperature": 0},
        headers=ENGINE_HEADERS,
        timeout=60,
    )
    response.raise_for_status()
    text: str = response.json()["choices"][0]["text"]
    return text


def _upload_and_validate(people: TenantPeople, capture: Any, name: str, weights: bytes) -> Adapter:
    with capture():
        response = client_for(people.developer).post(
            "/api/tenants/acme/adapters/upload/",
            {
                "name": name,
                "adapter_config": SimpleUploadedFile("adapter_config.json", config()),
                "adapter_model": SimpleUploadedFile("adapter_model.safetensors", weights),
            },
            format="multipart",
        )
    assert response.status_code == 202
    adapter = adapter_validate(adapter_id=Adapter.objects.get(name=name).pk)
    assert adapter.status == "ready", adapter.reason
    return adapter


def test_a_validated_adapter_loads_and_changes_the_output(
    people: TenantPeople,
    served: Path,  # noqa: F811
    lora_engine: Engine,
    django_capture_on_commit_callbacks: Any,
) -> None:
    weights = safetensors(lora_tensors())
    one = _upload_and_validate(people, django_capture_on_commit_callbacks, "bot", weights)
    # A second adapter, same layout, other weights: every value times -3.
    other = scaled_weights(weights, -3)
    two = _upload_and_validate(people, django_capture_on_commit_callbacks, "bot-b", other)

    for adapter in (one, two):
        loaded = httpx.post(
            f"{lora_engine.url}/v1/load_lora_adapter",
            json={
                "lora_name": f"acme/{adapter.name}",
                "lora_path": adapter_local_dir(adapter=adapter),
            },
            headers=ENGINE_HEADERS,
            timeout=60,
        )
        assert loaded.status_code == 200, loaded.text
    base = _greedy(lora_engine, "tiny-chat")
    first = _greedy(lora_engine, "acme/bot")
    second = _greedy(lora_engine, "acme/bot-b")
    assert first != base and second != base and first != second
    assert _greedy(lora_engine, "acme/bot") == first  # stable
