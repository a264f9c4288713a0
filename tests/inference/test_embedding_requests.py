"""An embeddings request as the gateway reads it and as the engine is sent it (no engine)."""

from __future__ import annotations

import orjson
import pytest

from inference.gateway.errors import ApiError
from inference.gateway.schema import MAX_EMBEDDING_INPUTS, parse_request, upstream_body


def _parse(**body: object) -> object:
    return parse_request(orjson.dumps({"model": "tiny-embed", **body}), "embeddings")


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("a cat", 1),
        (["a cat", "a dog"], 2),
        ([1, 2, 3], 1),
        ([[1, 2], [3]], 2),
        # One input of token ids longer than the cap on inputs is still one input.
        (list(range(MAX_EMBEDDING_INPUTS + 50)), 1),
    ],
)
def test_each_input_shape_is_a_sequence_of_prompt_tokens_only(given: object, inputs: int) -> None:
    parsed = parse_request(orjson.dumps({"model": "tiny-embed", "input": given}), "embeddings")
    assert (parsed.prompts, parsed.sequences, parsed.max_tokens) == (inputs, inputs, None)
    assert parsed.prompt_estimate > 0 and not parsed.stream
    sent = orjson.loads(
        upstream_body(parsed, served_name="engine-name", max_tokens=None, cache_salt="s1")
    )
    # What the engine gets: the input as given, the served name, the tenant's partition, and
    # nothing of a completion's (no stream, no max_tokens).
    assert sent == {"model": "engine-name", "input": given, "cache_salt": "s1"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
        ({"input": [[1]] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
        ({"input": [1, -2]}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "stream": True}, "stream"),  # not an embeddings field
        ({}, "input"),
    ],
)
def test_a_bad_request_is_refused_naming_its_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        _parse(**body)
    assert refused.value.status == 400 and refused.value.param == param
