"""A request's priority class (inference.gateway.priority), and the key's class as the
gateway caches it: a request may lower its class, never raise it."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from inference.gateway.auth import KeyInfo
from inference.gateway.errors import ApiError
from inference.gateway.priority import request_class

KEY = KeyInfo(1, "p", "d", 1, "acme", 1, frozenset(), None, (), (), priority="standard")


@pytest.mark.parametrize(
    ("asked", "runs_in"),
    [
        (None, "standard"),
        ("auto", "standard"),
        ("default", "standard"),
        ("standard", "standard"),
        ("flex", "background"),
        ("background", "background"),
    ],
)
def test_a_request_runs_in_its_keys_class_or_a_lower_one_it_asks_for(
    asked: str | None, runs_in: str
) -> None:
    assert request_class(KEY, asked, mode="online") == runs_in


@pytest.mark.parametrize("asked", ["priority", "interactive"])
def test_a_request_cannot_raise_its_class(asked: str) -> None:
    with pytest.raises(ApiError) as caught:
        request_class(KEY, asked, mode="online")
    error = caught.value
    assert (error.status, error.code, error.param) == (403, "priority_not_allowed", "service_tier")
    assert "'standard'" in str(error) and "'interactive'" in str(error)


@pytest.mark.parametrize("asked", ["scale", "urgent", "", 3])
def test_an_unknown_service_tier_is_a_clear_400(asked: object) -> None:
    with pytest.raises(ApiError) as caught:
        request_class(KEY, asked, mode="online")
    assert (caught.value.status, caught.value.code) == (400, "invalid_service_tier")
    assert "flex" in str(caught.value)


def test_an_interactive_key_may_ask_for_any_class_and_batch_lines_run_last() -> None:
    top = dataclasses.replace(KEY, priority="interactive")
    assert request_class(top, "priority", mode="online") == "interactive"
    assert request_class(top, "flex", mode="online") == "background"
    assert request_class(top, "priority", mode="batch") == "background"
    assert request_class(top, None, mode="batch") == "background"


def test_the_keys_class_survives_the_gateways_key_cache() -> None:
    top = dataclasses.replace(KEY, priority="interactive")
    assert KeyInfo.from_json(top.to_json()).priority == "interactive"
    # An entry cached before classes existed (without the last field) reads as the default.
    old = orjson.dumps(orjson.loads(top.to_json())[:-1])
    assert KeyInfo.from_json(old).priority == "standard"
