"""The gateway's metric helpers on their own: what they add is what plain observations add."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from inference.gateway import metrics
from inference.gateway.errors import ERROR_KINDS, ApiError, overloaded


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_a_stream_s_gaps_add_up_as_one_observation_each(monkeypatch: Any) -> None:
    gaps = [0.004, 0.01, 0.03, 0.03, 0.2, 1.7, 95.0]  # one above every bucket
    plain, batched = CollectorRegistry(), CollectorRegistry()
    buckets = metrics.INTER_TOKEN_LATENCY_BUCKETS
    one = Histogram("gap_seconds", "g", ["pool", "model"], buckets=buckets, registry=plain)
    many = Histogram("gap_seconds", "g", ["pool", "model"], buckets=buckets, registry=batched)
    for gap in gaps:
        one.labels("online", "tiny-chat").observe(gap)
    monkeypatch.setattr(metrics, "ITL", many)
    counted = metrics.TokenGaps()
    for gap in gaps:
        counted.add(gap)
    counted.flush(pool="online", model="tiny-chat")
    assert _samples(batched) == _samples(plain)
    counted.flush(pool="online", model="tiny-chat")  # flushed once: nothing more
    assert _samples(batched) == _samples(plain)


def test_the_tenant_label_is_capped_and_the_rest_are_other() -> None:
    labels = metrics.TenantLabels(3)
    assert [labels(f"t{i}") for i in range(5)] == ["t0", "t1", "t2", "other", "other"]
    assert labels("t1") == "t1"  # one seen before keeps its label


def test_every_error_has_a_kind_from_the_fixed_set() -> None:
    made = [
        ApiError(401, "no"),
        ApiError(403, "no"),
        ApiError(429, "slow down"),
        overloaded(1),
        overloaded(1, kind="queue_timeout"),
        ApiError(400, "bad"),
        ApiError(404, "no such model"),
        ApiError(400, "flagged", code="content_policy_violation"),
        ApiError(500, "bug"),
        ApiError(502, "engine"),
        ApiError(503, "adapter", kind="adapter_load"),
    ]
    kinds = [error.kind for error in made]
    assert kinds == [
        "auth",
        "auth",
        "rate_limited",
        "overloaded",
        "queue_timeout",
        "invalid_request",
        "invalid_request",
        "content_filter",
        "internal",
        "upstream",
        "adapter_load",
    ]
    assert set(kinds) <= set(ERROR_KINDS)
