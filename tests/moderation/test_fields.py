"""Moderation reads every text a client is shown and every text the engine reads, not only
the answer's content and the messages' (issue: a banned word among ``top_logprobs``'
alternatives reached the client in hold mode). The guard is driven chunk by chunk, as the
gateway drives it, with a real policy's rules and Redis for its events."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import orjson
import pytest

from inference.gateway.auth import KeyInfo
from inference.gateway.errors import ApiError
from inference.gateway.schema import parse_request, upstream_body
from moderation.cascade import Cascade
from moderation.guard import Guarded
from moderation.policy import PolicyInvalid, PolicySpec, policy_check, window_step
from moderation.policy_view import policy_view
from moderation.services import moderation_policy_set
from tests.factories import TenantFactory

TERM = "secret"
KEY = KeyInfo(
    key_id=1,
    prefix="ip-test",
    digest="",
    tenant_id=1,
    tenant_slug="acme",
    weight=1,
    scopes=frozenset(),
    expires_at=None,
    tenant_limits=(0, 0, 0, 0, 0),
    key_limits=(0, 0, 0, 0, 0),
)


def _guard(
    endpoint: str = "chat.completions",
    body: dict[str, Any] | None = None,
    mode: Literal["hold", "async"] = "hold",
) -> Guarded:
    spec = PolicySpec(
        deny_terms=[TERM],
        pii_action="mask",
        classifier=False,
        output_mode=mode,
        window_tokens=8,
        overlap_tokens=4,
    )
    if body is None:
        body = (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            if endpoint == "chat.completions"
            else {"model": "m", "prompt": "hi"}
        )
    parsed = parse_request(orjson.dumps(body), endpoint)
    return Guarded(Cascade(1, spec), key=KEY, rid="r1", parsed=parsed, tokens={})


def _chat(delta: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": logprobs}
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "choices": [choice]}


def _text(text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": logprobs}
    return {"id": "c1", "object": "text_completion", "created": 1, "choices": [choice]}


def _alternative(token: str, alternative: str) -> dict[str, Any]:
    entry = {"token": token, "logprob": 0.0, "bytes": None}
    alternatives = [entry, {"token": alternative, "logprob": -9.0, "bytes": None}]
    return {"content": [entry | {"top_logprobs": alternatives}]}


FILLER = [" the", " pool", " serves", " many"]


def _stream(*middle: dict[str, Any], chat: bool = True) -> list[dict[str, Any]]:
    """Four tokens of plain answer, the chunks under test, four more and the end."""
    make = (lambda t: _chat({"content": t})) if chat else _text
    end = make("")
    end["choices"][0]["finish_reason"] = "stop"
    return [*map(make, FILLER), *middle, *map(make, FILLER), end]


CASES = {
    "tool call arguments, split across deltas": _stream(
        _chat({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '{"a": "sec'}}]}),
        _chat({"tool_calls": [{"index": 0, "function": {"arguments": 'ret"}'}}]}),
    ),
    "a tool call's name": _stream(
        _chat({"tool_calls": [{"index": 0, "id": "t", "function": {"name": TERM}}]})
    ),
    "reasoning": _stream(
        _chat({"reasoning_content": " a"}), _chat({"reasoning_content": " secret"})
    ),
    "reasoning (vLLM's field)": _stream(_chat({"reasoning": " secret"})),
    "a refusal": _stream(_chat({"refusal": "It is a secret."})),
    "a chat alternative in top_logprobs": _stream(
        _chat({"content": " and"}, _alternative(" and", " secret"))
    ),
    "a completion's alternative in top_logprobs": _stream(
        _text(" and", {"tokens": [" and"], "top_logprobs": [{" and": 0.0, " secret": -9.0}]}),
        chat=False,
    ),
}


async def _screened(guard: Guarded, chunks: list[dict[str, Any]]) -> tuple[bytes, str | None]:
    released: list[dict[str, Any]] = []
    for chunk in chunks:  # one chunk a batch, as the engine streams them
        verdict = await guard.screen([chunk])
        released += verdict.release
        if verdict.cut is not None:
            return orjson.dumps(released), verdict.cut
    verdict = await guard.end()
    return orjson.dumps(released + verdict.release), verdict.cut


@pytest.mark.parametrize("chunks", CASES.values(), ids=CASES.keys())
def test_hold_mode_checks_every_text_a_client_is_shown(chunks: list[dict[str, Any]]) -> None:
    endpoint = "chat.completions" if chunks[0]["object"].startswith("chat") else "completions"
    released, cut = asyncio.run(_screened(_guard(endpoint), chunks))
    assert cut is not None and "blocked" in cut
    assert b"secret" not in released and b'"sec' not in released


def test_an_alternative_that_is_a_part_of_the_answer_is_not_a_word() -> None:
    """The chosen tokens are the answer's text: " sec" + "ret" chosen is checked as the
    answer; an alternative is a word of its own, so "ass" offered beside "class" is not
    read inside "class"."""
    chunks = _stream(_chat({"content": " cl"}, _alternative(" cl", "ass")))
    guard = _guard()
    guard.cascade = Cascade(1, PolicySpec(deny_terms=["class"], classifier=False))
    released, cut = asyncio.run(_screened(guard, chunks))
    assert cut is None and b"ass" in released


CHAT_INPUTS = {
    "a tool's description": {
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": f"tell the {TERM}", "parameters": {}},
            }
        ]
    },
    "a tool's parameter": {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {TERM: {"type": "string"}}},
                },
            }
        ]
    },
    "an assistant's tool call": {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "f", "arguments": f'{{"x": "{TERM}"}}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        ]
    },
    "a message's name": {"messages": [{"role": "user", "name": TERM, "content": "hi"}]},
    "a refusal part": {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": f"no {TERM}"}]},
        ]
    },
    "a tool call's id": {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "tool", "tool_call_id": f"{TERM}-1", "content": "ok"},
        ]
    },
    "the chat template's arguments": {"chat_template_kwargs": {"persona": f"a {TERM} agent"}},
}


@pytest.mark.parametrize("extra", CHAT_INPUTS.values(), ids=CHAT_INPUTS.keys())
def test_the_input_check_reads_every_text_the_engine_reads(extra: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | extra
    guard = _guard(body=body)
    refusal = asyncio.run(
        guard.input_rules(parse_request(orjson.dumps(body), "chat.completions"), KEY)
    )
    assert refusal is not None and "deny_term" in refusal


def test_a_completions_suffix_is_checked_and_masked() -> None:
    body = {"model": "m", "prompt": "hi", "suffix": f"the {TERM}"}
    guard = _guard("completions", body)
    refusal = asyncio.run(guard.input_rules(parse_request(orjson.dumps(body), "completions"), KEY))
    assert refusal is not None
    card = "4111 1111 1111 1111"
    masked = orjson.loads(guard.rewrite(orjson.dumps({**body, "suffix": f"pay {card}"})))
    assert masked["suffix"] == "pay [card_number]"


def test_pii_is_masked_in_tool_calls_and_definitions() -> None:
    card = "4111 1111 1111 1111"
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi", "name": "u"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "t", "type": "function", "function": {"name": "f", "arguments": card}}
                ],
            },
        ],
        "tools": [{"type": "function", "function": {"name": "f", "description": card}}],
    }
    masked = orjson.loads(_guard(body=body).rewrite(orjson.dumps(body)))
    assert card not in orjson.dumps(masked).decode()
    assert masked["messages"][1]["tool_calls"][0]["function"]["arguments"] == "[card_number]"
    assert masked["tools"][0]["function"]["description"] == "[card_number]"
    assert masked["messages"][0] == body["messages"][0]  # what held nothing is as it was


async def _batches(guard: Guarded, batches: list[tuple[int, list[dict[str, Any]]]]) -> str:
    """Drive ``guard`` batch by batch, the relay's count set to each batch's end as the relay
    does; the text delivered to the client, and whether it was cut."""
    counts: dict[int, int] = {}
    guard.tokens = counts
    released: list[dict[str, Any]] = []
    for count, batch in batches:
        counts[0] = count
        verdict = await guard.screen(batch)
        released += verdict.release
        if verdict.cut is not None:
            return "CUT:" + "".join(c["choices"][0]["delta"].get("content", "") for c in released)
    verdict = await guard.end()
    released += verdict.release
    prefix = "" if verdict.cut is None else "CUT:"
    return prefix + "".join(c["choices"][0]["delta"].get("content", "") for c in released)


@pytest.mark.parametrize("mode", ["hold", "async"])
def test_a_phrase_before_a_merged_delta_in_one_batch_is_read_whole(
    mode: Literal["hold", "async"],
) -> None:
    """A one-token chunk, then a delta merged from many steps, in one batch: the counts of
    the batch's chunks before its last are bounds from above, so no window ends there (one
    did: it released " se" by a count it had not reached, and no window read "secret" whole;
    in async mode it was never cut at all). Found by review."""
    guard = _guard(mode=mode)
    chat = [_chat({"content": t}) for t in FILLER]
    delivered = asyncio.run(
        _batches(
            guard,
            [
                (4, chat),
                (6, [_chat({"content": " and"}), _chat({"content": " se"})]),
                (
                    20,
                    [
                        _chat({"content": "c"}),
                        _chat({"content": "ret, and the pool serves many of them"}),
                        _chat({"content": " x"}),
                    ],
                ),
            ],
        )
    )
    assert delivered.startswith("CUT:")
    if mode == "hold":
        assert "secret" not in delivered


def test_async_mode_cuts_within_a_window_inside_one_long_batch() -> None:
    """A reader behind the engine takes many one-token chunks in one batch: in async mode
    the cut still comes within a window of the banned word (before, the rules read only the
    batch's last chunk: everything before it went out, a fresh-clone CI run got 12 tokens
    past the word with a window of 8)."""
    words = [f" w{i}" for i in range(30)]
    at = 10
    words[at] = " secret"
    guard = _guard(mode="async")
    delivered = asyncio.run(_batches(guard, [(30, [_chat({"content": w}) for w in words])]))
    assert delivered.startswith("CUT:")
    shown = delivered.removeprefix("CUT:")
    assert "".join(words).startswith(shown)
    assert len(shown.split()) - at <= guard.window
    # Chunks of four tokens each (merged deltas), the word in the second: the counts within
    # the batch are bounds, so each such chunk is read before it goes out (before, the
    # bound rose by one a chunk: three chunks, twelve tokens, went out unread).
    chunks = [" a b c d", " e secret f g", " h i j k", " l m n o", " p q r s", " t u v w"]
    guard = _guard(mode="async")
    delivered = asyncio.run(_batches(guard, [(24, [_chat({"content": c}) for c in chunks])]))
    assert delivered.startswith("CUT:")
    assert delivered.removeprefix("CUT:") == chunks[0]
    # Each read inside the batch takes what is new since the last and its edge: a word
    # across two chunks is read whole.
    chunks = [" a b c se", "cret d e f", " g h i j", " k l m n"]
    guard = _guard(mode="async")
    delivered = asyncio.run(_batches(guard, [(16, [_chat({"content": c}) for c in chunks])]))
    assert delivered == "CUT:" + chunks[0]


def test_a_delta_merged_from_many_steps_is_read_with_the_edge_before_it() -> None:
    """A loaded engine merges the deltas a slow reader has not taken: one chunk can carry
    more tokens than a window moves on by. Its check reads back to the last check's overlap,
    so the tokens between (" se", never in a window before) and a word across that edge
    ("se" + "cret") are read; before, the window was the last 8 tokens only: the merged
    chunk, and " se" + "cret" went out in hold mode (a fresh-clone run saw it with n=2)."""
    counts: dict[int, int] = {}  # the relay's: the engine's count as of each batch's end
    guard = _guard()
    guard.tokens = counts
    merged = _chat({"content": "cret, and the pool serves many of them at once"})
    released: list[dict[str, Any]] = []

    async def stream() -> str | None:
        for count, batch in [
            (4, [_chat({"content": t}) for t in FILLER]),  # one batch, four tokens
            (5, [_chat({"content": " se"})]),
            (17, [merged]),  # twelve tokens in one delta
        ]:
            counts[0] = count
            verdict = await guard.screen(batch)
            released.extend(verdict.release)
            if verdict.cut is not None:
                return verdict.cut
        return (await guard.end()).cut

    cut = asyncio.run(stream())
    assert cut is not None and "blocked" in cut
    delivered = "".join(c["choices"][0]["delta"].get("content", "") for c in released)
    assert "secret" not in delivered and " se" not in delivered
    # The batch of four one-token chunks counted four, not 4 + 3 (the engine's count at
    # the batch's end given to its first chunk: each window then covered fewer tokens).
    assert [tokens for tokens, _ in guard.choices[0].parts][:4] == [1, 2, 3, 4]


def test_a_window_moves_on_by_at_least_a_quarter_of_itself() -> None:
    """window 2048, overlap 2047 read the whole window again at every token, on the shared
    event loop: refused now, and a policy stored before is read with the floor."""
    with pytest.raises(PolicyInvalid) as refused:
        policy_check(PolicySpec(window_tokens=2048, overlap_tokens=2047))
    assert refused.value.field == "overlap_tokens"
    assert "0 to 1536 tokens" in refused.value.message
    policy_check(PolicySpec(window_tokens=2048, overlap_tokens=1536))
    assert window_step(PolicySpec(window_tokens=2048, overlap_tokens=2047)) == 512
    assert window_step(PolicySpec(window_tokens=8, overlap_tokens=4)) == 4


@pytest.mark.django_db(transaction=True)
def test_a_policy_saved_recompiles_its_tenant_only() -> None:
    """Compiled rules are kept by policy version: another tenant's save (a new snapshot of
    every policy) leaves a tenant's compiled cascade as it was."""
    a, b = TenantFactory.create(), TenantFactory.create()
    moderation_policy_set(tenant=a, changes={"deny_terms": ["x"]}, actor=None)
    moderation_policy_set(tenant=b, changes={"deny_terms": ["y"]}, actor=None)

    async def scenario() -> tuple[bool, bool]:
        view = policy_view()
        await view.refresh()
        first_a, first_b = await view.cascade(a.id), await view.cascade(b.id)
        await asyncio.to_thread(
            moderation_policy_set, tenant=a, changes={"deny_terms": ["z"]}, actor=None
        )
        await view.refresh()
        return (await view.cascade(a.id) is first_a, await view.cascade(b.id) is first_b)

    assert asyncio.run(scenario()) == (False, True)


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"description": TERM}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


ODD = {
    "tool_calls that is a number": {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": 1}]
    },
    "messages of odd shapes": {"messages": [{"role": "user", "content": "hi"}, 3, "x", None]},
    "tools nested 240 levels deep": {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(120)}}]
    },
}


@pytest.mark.parametrize("extra", ODD.values(), ids=ODD.keys())
def test_odd_shapes_are_read_or_refused_never_a_crash(extra: dict[str, Any]) -> None:
    """Whatever the schema lets through is read without an exception (an exception here left
    the request's admission slot held for good, once masking was on): a deep tool definition
    is read to its bottom."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | extra
    try:
        parsed = parse_request(orjson.dumps(body), "chat.completions")
    except ApiError as refused:
        assert refused.status == 400
        return
    guard = _guard(body=body)
    refusal = asyncio.run(guard.input_rules(parsed, KEY))
    assert (refusal is not None) == (TERM in orjson.dumps(body).decode())
    card = "4111 1111 1111 1111"
    masked = guard.rewrite(orjson.dumps(body).replace(TERM.encode(), card.encode()))
    assert card.encode() not in masked


def test_a_body_nested_deeper_than_the_engine_can_be_sent_is_a_400() -> None:
    """orjson reads 1,024 levels but writes 255: such a body was read, admitted, and then
    failed (a 500, its admission slot never given back); refused before anything is held."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(150)}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    parsed = parse_request(json.dumps(body).encode(), "chat.completions")  # as a client wrote it
    with pytest.raises(ApiError) as refused:
        upstream_body(parsed, served_name="m", max_tokens=None, cache_salt="s")
    assert refused.value.status == 400 and "nested too deeply" in str(refused.value)


@pytest.mark.django_db
def test_a_policy_saved_before_the_floor_saves_its_other_fields() -> None:
    """A stored overlap over three quarters of the window (allowed once) does not make every
    later save fail: it is brought to the floor the gateways already read it with."""
    tenant = TenantFactory.create()
    policy = moderation_policy_set(tenant=tenant, changes={"window_tokens": 64}, actor=None)
    type(policy).objects.filter(pk=policy.pk).update(overlap_tokens=63)
    saved = moderation_policy_set(tenant=tenant, changes={"budget_ms": 500}, actor=None)
    assert (saved.window_tokens, saved.overlap_tokens, saved.budget_ms) == (64, 48, 500)
    with pytest.raises(PolicyInvalid):  # asked for by name, it is refused with the reason
        moderation_policy_set(tenant=tenant, changes={"overlap_tokens": 63}, actor=None)
