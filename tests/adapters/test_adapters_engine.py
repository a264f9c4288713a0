"""A validated adapter is one a real vLLM CPU engine accepts and applies: loaded from where
validation stored it, its greedy output differs from the base model's and is stable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from django.core.files.uploadedfile import SimpleUploadedFile

from adapters.models import Adapter
from adapters.services import adapter_local_dir, adapter_validate
from devkit.adapters import config, lora_tensors, safetensors
from tests.adapters.test_adapters import served  # noqa: F401  (fixture)
from tests.conftest import TenantPeople, client_for
from tests.engines import ENGINE_HEADERS, Engine


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
    # A second adapter, same layout, weights that point another way.
    other = safetensors(lora_tensors(), variant=1)
    two = _upload_and_validate(people, django_capture_on_commit_callbacks, "bot-b", other)

    names = [f"acme/{adapter.name}" for adapter in (one, two)]
    try:
        _compare(lora_engine, one, two)
    finally:  # the engine is the session's: the gateway's LoRA tests count what it holds
        for name in names:
            httpx.post(
                f"{lora_engine.url}/v1/unload_lora_adapter",
                json={"lora_name": name},
                headers=ENGINE_HEADERS,
                timeout=60,
            )


def _compare(lora_engine: Engine, one: Adapter, two: Adapter) -> None:
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
