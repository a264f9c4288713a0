"""The Lua helper (inference/gateway/lua.py) against real Redis: scripts load from their files
with the shared prelude, and a batch survives a Redis that lost its scripts (a restart) by
loading them and running again exactly what failed — never a command twice."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
from django.conf import settings
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from inference.gateway import cache, cache_semantic, limits, lora
from inference.gateway.admission import scripts as admission
from inference.gateway.lua import LUA_DIR, Batch, Script
from inference.gateway.redis import _HiredisPacking, redis_async
from inference.services import probes
from tests.conftest import state_redis_use


def test_every_script_file_is_used_and_has_the_shared_clock() -> None:
    scripts = [
        v
        for module in (admission, cache, cache_semantic, limits, lora, probes)
        for v in vars(module).values()
        if isinstance(v, Script)
    ]
    names = {s.name for s in scripts}
    files = {
        str(p.relative_to(LUA_DIR).with_suffix(""))
        for p in LUA_DIR.rglob("*.lua")
        if p.name not in ("prelude.lua", "common.lua")
    }
    assert names == files
    assert all("redis.call('TIME')" in s.source for s in scripts)
    assert "local HOLD = 100" in admission.ENQUEUE.source  # the constant from Python


async def test_scripts_run_and_share_the_prelude() -> None:
    client = redis_async()
    await client.set("lua-test-lock", "token")
    assert await lora._UNLOCK(keys=["lua-test-lock"], args=["other"]) == 0
    assert await lora._UNLOCK(keys=["lua-test-lock"], args=["token"]) == 1
    assert await client.exists("lua-test-lock") == 0


async def test_a_batch_after_redis_lost_its_scripts_runs_each_command_once() -> None:
    client = redis_async()
    await client.set("lua-test-lock", "token")
    await lora._UNLOCK(keys=["lua-test-lock"], args=["token"])  # loaded once
    await client.script_flush()  # what a Redis restart does
    await client.set("lua-test-lock", "token2")
    batch = Batch()
    batch.incr("lua-test-counter")
    batch.script(lora._UNLOCK, ["lua-test-lock"], ["token2"])
    batch.incr("lua-test-counter")
    assert await batch.execute() == [1, 1, 2]
    assert await client.get("lua-test-counter") == b"2"  # the plain commands ran once
    assert await client.exists("lua-test-lock") == 0
    assert await client.script_exists(lora._UNLOCK.sha) == [True]


async def test_the_hot_paths_commands_are_packed_by_hiredis_into_redis_pys_own_bytes() -> None:
    """The gateway's client packs with hiredis (``inference.gateway.redis._HiredisPacking``):
    the bytes are those redis-py's own packer writes, for a script call's strings, integers
    and floats, and a command with a space in its name; what it cannot send is a DataError,
    as redis-py's; commands and scripts still run (on one Redis, or on a Redis Cluster in
    the cluster group)."""
    client = redis_async()
    assert await client.set("lua-test-packed", "x")
    assert await client.get("lua-test-packed") == b"x"
    await client.delete("lua-test-packed")
    batch = Batch()
    batch.script(lora._UNLOCK, ["lua-test-packed"], ["token"])
    batch.incr("lua-test-packed-n")
    assert await batch.execute() == [0, 1]
    nodes = client.get_nodes() if hasattr(client, "get_nodes") else [client]
    classes = {
        n.connection_class if hasattr(n, "connection_class") else n.connection_pool.connection_class
        for n in nodes
    }
    assert all(issubclass(c, _HiredisPacking) for c in classes), classes
    packed = next(iter(classes))()
    plain = Connection()
    for args in (
        ("EVALSHA", "a" * 40, 1, "ip:{p:x}:", 20000, 1, "rid", 1.5, -3, "é", b"\x00\xff", ""),
        ("CLIENT SETNAME", "inferplane"),
        (b"CONFIG GET", b"maxmemory"),
        ("SET", bytearray(b"k"), memoryview(b"v")),  # hiredis refuses the bytearray
    ):
        assert b"".join(packed.pack_command(*args)) == b"".join(plain.pack_command(*args))
    with pytest.raises(DataError):
        packed.pack_command("SET", "k", {"not": "sendable"})  # type: ignore[arg-type]


def test_the_redis_py_that_sent_once_was_read_against_is_the_one_installed() -> None:
    """``_SentOnce`` replaces redis-py's cluster pipeline strategy and uses its private parts
    (``_execute``, ``_command_queue``, the client's ``_initialize``), read in redis-py 8.1.0.
    An upgrade can change them without a word: re-read ``PipelineStrategy.execute`` and its
    retry, run the dead-node tests (``tests/inference/test_cluster.py``, make test's cluster
    group), then move this pin with pyproject.toml's and the lock file's."""
    assert redis.__version__ == "8.1.0", "re-read inference.gateway.redis._SentOnce first"


async def test_the_batches_of_one_turn_share_a_round_trip_each_with_its_own_results(
    private_redis: tuple[str, Any],
) -> None:
    """Every batch executed in one turn of the event loop goes out in one pipeline on the
    next (``lua._Pipelining``): one read for Redis however many requests settle together,
    and each batch still gets its own results, and its own errors only. On a Redis of the
    test's own, so that its count of reads is this test's alone."""
    url, _ = private_redis
    plain = settings.STATE_REDIS_URL
    state_redis_use(url)
    try:
        server = redis.Redis.from_url(url)
        server.set("lua-test-text", "not a number")
        await redis_async().ping()  # connected before counting
        reads = server.info("stats")["total_reads_processed"]

        async def one(i: int) -> list[Any]:
            batch = Batch()
            batch.incrby(f"lua-test-{i}", i)
            if i == 3:
                batch.incr("lua-test-text")  # fails: this batch's own error
            batch.incr(f"lua-test-{i}")
            return await batch.execute(raise_errors=False)

        results = await asyncio.gather(*(one(i) for i in range(20)))
        # Twenty pipelines of their own were twenty reads (and twenty connections).
        assert server.info("stats")["total_reads_processed"] - reads <= 3
        # A batch that cannot be written (an argument Redis has no type for, a str that is
        # not UTF-8) fails alone.
        unwritable, not_text, written = Batch(), Batch(), Batch()
        unwritable.set("lua-test-unwritable", {"a": 1})
        not_text.set("lua-test-unwritable", "\ud800")
        written.incr("lua-test-written")
        outcomes = await asyncio.gather(
            unwritable.execute(), not_text.execute(), written.execute(), return_exceptions=True
        )
        assert isinstance(outcomes[0], DataError) and isinstance(outcomes[1], DataError)
        assert outcomes[2] == [1]
        # A batch whose caller is cancelled before its turn is never sent.
        cancelled = Batch()
        cancelled.incr("lua-test-cancelled")
        task = asyncio.ensure_future(cancelled.execute())
        await asyncio.sleep(0)  # it has queued itself for the next turn
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await written.execute()  # a turn later
        assert server.get("lua-test-cancelled") is None
        assert server.get("lua-test-written") == b"2"
    finally:
        state_redis_use(plain)
    for i, result in enumerate(results):
        if i == 3:
            assert result[0] == 3 and isinstance(result[1], redis.ResponseError)
            assert result[2] == 4
        else:
            assert result == [i, i + 1]
    with pytest.raises(redis.ResponseError):  # raised to the batch it belongs to
        await _failing_batch(url)


async def _failing_batch(url: str) -> None:
    plain = settings.STATE_REDIS_URL
    state_redis_use(url)
    try:
        batch = Batch()
        batch.incr("lua-test-text")
        await batch.execute()
    finally:
        state_redis_use(plain)
