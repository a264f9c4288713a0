"""What one tenant can read through, or do to, the engine another tenant uses: its prefix
cache is partitioned, and a short request is not held up by other tenants' long streams
(bench/isolation.py is the full measurement). The engine here is started with ``make run``'s
script and scheduling (tests.engines)."""

from __future__ import annotations

import secrets
import threading
from typing import Any

import httpx
import pytest

from tests.live import engine_counters, wait_for
from tests.serving import World

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

LONG = {
    "model": "tiny-chat",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 900,
    "ignore_eos": True,
    "stream": True,
}


def test_the_prefix_cache_is_partitioned_by_tenant(world: World) -> None:
    """Tenant A's repeated prompt hits A's own prefix cache; tenant B sending the very same
    prompt reads nothing of it (``cached_tokens`` 0: unpartitioned, the engine told B 512,
    that is, that someone had sent that text). B's own repeat hits B's own. A client's
    ``cache_salt`` narrows its tenant's partition, never joins another's."""
    _, a = world.tenant()
    _, b = world.tenant()
    # Over four blocks of 128 tokens: the engine caches whole blocks only.
    text = secrets.token_hex(8) + " the pool serves many tenant request" * 110
    messages: Any = [{"role": "user", "content": text}]
    blocks: list[int] = []

    def cached(key: str, **extra: str) -> int:
        reply = world.stack.openai(key).chat.completions.create(
            model="tiny-chat", messages=messages, max_tokens=1, extra_body=extra or None
        )
        assert reply.usage is not None and 512 < reply.usage.prompt_tokens < 1000
        # Its whole blocks: a hit still leaves the last token to compute.
        blocks.append((reply.usage.prompt_tokens - 1) // 128 * 128)
        details = reply.usage.prompt_tokens_details
        return (details.cached_tokens if details else 0) or 0

    assert cached(a) == 0
    assert cached(a) == blocks[-1]  # A's repeat: every whole block of it
    assert cached(b) == 0  # B learns nothing of A's prompt
    assert cached(b) == blocks[-1]
    assert cached(a, cache_salt="team-1") == 0  # narrowed: a partition of its own
    assert cached(a, cache_salt="team-1") == blocks[-1]
    assert cached(b, cache_salt="team-1") == 0  # the same client salt, another tenant


def test_short_requests_are_served_beside_another_tenant_s_long_streams(world: World) -> None:
    """Two long streams of another tenant hold the engine; one-token requests sent meanwhile
    are each admitted and answered at once, not refused or queued behind them, and the long
    streams are still running when the last one is answered.

    How long they take beside the streams, against the engine directly, is a measurement
    (``bench.isolation``: gateway/direct p99 0.89), not an assertion here: on two shared
    cores it moved with whatever else the machine ran (a slowest-tenth ratio of 3.46 in one
    loaded CI run, 0.8-1.0 alone or beside two busy loops), and it did not tell the cause it
    was meant to catch — the engine at full scheduling weight gave 1.57, since the client
    starves too. That cause is checked directly: tests/test_engine_scheduling.py reads the
    engine's scheduling weight from the kernel."""
    _, short_key = world.tenant()
    _, long_key = world.tenant()
    finished = threading.Event()
    stop = threading.Event()

    def neighbour() -> None:
        with (
            httpx.Client(timeout=120) as client,
            client.stream(
                "POST",
                f"{world.stack.url}/v1/chat/completions",
                headers={"authorization": f"Bearer {long_key}"},
                json=LONG,
            ) as response,
        ):
            for _ in response.iter_bytes():
                if stop.is_set():
                    return
        finished.set()

    threads = [threading.Thread(target=neighbour) for _ in range(2)]
    for thread in threads:
        thread.start()
    client = world.stack.openai(short_key)
    try:
        # The two long streams are past their prefill: the engine runs them.
        wait_for(
            lambda: engine_counters(world.engines[0])["vllm:num_requests_running"] >= 2,
            timeout=60,
            every=0.05,
        )
        for _ in range(SHORTS):
            reply = client.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 1
            assert not finished.is_set(), "a long stream ended before the short requests did"
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)


# Few enough to be answered while a 900-token stream runs (~30 ms each beside it, against
# seconds for the stream), many enough that one waiting behind the streams would show.
SHORTS = 10
