"""The gateway's Lua scripts: one file each under ``lua/``, loaded by one helper.

A script's source is, in order: its constants (``local NAME = value``, from Python, so the
numbers have one home), the shared prelude (``lua/prelude.lua``: the server clock), its
family's common part (``lua/<family>/common.lua``, when there is one) and its own file
(``lua/<family>/<name>.lua``).

Scripts run by EVALSHA, registered once per Redis client; a script called on its own is
reloaded by redis-py on NOSCRIPT. Scripts queued on a ``Batch`` (several commands in one
round trip) are sent by SHA only, and when Redis lost them (it restarted) the batch loads
them and replays exactly the commands that failed — so no caller keeps a second copy of its
work for that case. On a Redis Cluster a batch's commands go to the nodes of their slots at
once (one round trip each, side by side); a script's keys are all in one slot.

On one Redis, batches are pipelined together (``_Pipelining``): every batch executed during
one turn of the event loop goes out in one pipeline on the next turn, each batch's commands
together and in order, and each gets its own results back. Under load many requests reach the
same step in one turn (an engine answers several at once): one write and one read for all of
them, in the web process and in Redis (bench/RESULTS.md, the embeddings section: a quarter
less CPU per request in the web process, a third less in Redis). On a cluster each batch
keeps a pipeline of its own: a node that fails there fails the pipeline it was in, and
another request's batch must not go down with it.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import weakref
from collections.abc import Awaitable, Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import DataError, NoScriptError

from inference.gateway.redis import client_ready, redis_async

LUA_DIR = Path(__file__).with_name("lua")


@cache
def _read(relative: str) -> str:
    return (LUA_DIR / relative).read_text()


class Script:
    def __init__(
        self, family: str, name: str, *, constants: Mapping[str, int | float] | None = None
    ) -> None:
        header = "".join(f"local {k} = {v!r}\n" for k, v in (constants or {}).items())
        common = LUA_DIR / family / "common.lua"
        parts = [header, _read("prelude.lua")]
        if common.exists():
            parts.append(_read(f"{family}/common.lua"))
        parts.append(_read(f"{family}/{name}.lua"))
        self.name = f"{family}/{name}"
        self.source = "\n".join(parts)
        self.sha = hashlib.sha1(self.source.encode(), usedforsecurity=False).hexdigest()
        self._registered: dict[int, AsyncScript] = {}

    def _on(self, client: Any) -> AsyncScript:
        found = self._registered.get(id(client))
        if found is None:
            found = self._registered[id(client)] = client.register_script(self.source)
        return found

    async def __call__(self, *, keys: list[str], args: list[Any]) -> Any:
        return await self._on(redis_async())(keys=keys, args=args)

    def __repr__(self) -> str:
        return f"<Script {self.name} {self.sha[:8]}>"


Op = tuple[str, tuple[Any, ...], dict[str, Any], "Script | None"]


class _Pipelining:
    """One event loop's batches waiting for the next turn, sent then as one pipeline."""

    def __init__(self) -> None:
        self.waiting: list[tuple[list[Op], asyncio.Future[list[Any]]]] = []
        self.sending: set[asyncio.Task[None]] = set()

    def send(self, ops: list[Op]) -> asyncio.Future[list[Any]]:
        """``ops``' results (exceptions in place of the commands that failed), once sent."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        if not self.waiting:  # the first of this turn: the send runs on the next one
            task = asyncio.ensure_future(self._send())
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)
        self.waiting.append((ops, future))
        return future

    async def _send(self) -> None:
        # A batch whose caller was cancelled before this turn is not sent (as with a
        # pipeline of its own that was never written).
        waiting = [(ops, future) for ops, future in self.waiting if not future.done()]
        self.waiting = []
        if not waiting:
            return
        try:
            results = await _pipeline([op for ops, _ in waiting for op in ops])
        except DataError:
            # A command that cannot be written (an argument Redis has no type for: a bug, as
            # every argument is ours) stops the pipeline as it is queued or packed, before
            # anything is sent: its own batch's failure, not the others', so each goes alone.
            for ops, future in waiting:
                if not future.done():
                    await self._alone(ops, future)
            return
        except Exception as exc:  # the connection: every batch in it failed alike
            for _, future in waiting:
                _fail(future, exc)
            return
        at = 0
        for ops, future in waiting:
            if not future.done():
                future.set_result(results[at : at + len(ops)])
            at += len(ops)

    @staticmethod
    async def _alone(ops: list[Op], future: asyncio.Future[list[Any]]) -> None:
        try:
            results = await _pipeline(ops)
        except Exception as exc:
            _fail(future, exc)
        else:
            if not future.done():
                future.set_result(results)


def _fail(future: asyncio.Future[list[Any]], exc: Exception) -> None:
    """``exc`` to one batch's caller, as an exception of its own (each raise adds its
    frames to the exception's traceback: a shared one would mix the requests')."""
    if future.done():
        return
    try:
        own = copy.copy(exc)
    except Exception:  # an exception that cannot be copied is shared
        own = exc
    own.__cause__, own.__context__ = exc.__cause__, exc.__context__
    own.__suppress_context__ = exc.__suppress_context__
    future.set_exception(own)


async def _pipeline(ops: list[Op]) -> list[Any]:
    """``ops`` in one pipeline: their results, an exception in place of each that failed."""
    # (A new cluster client learns its nodes first: ``client_ready``.)
    pipe = (await client_ready(redis_async())).pipeline(transaction=False)
    for command, args, kwargs, _script in ops:
        getattr(pipe, command)(*args, **kwargs)
    # (On a cluster the pipeline is sent once, never retried: ``redis._SentOnce``.)
    results: list[Any] = await pipe.execute(raise_on_error=False)
    return results


_pipelining: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pipelining] = (
    weakref.WeakKeyDictionary()
)


def _pipelining_here() -> _Pipelining:
    loop = asyncio.get_running_loop()
    found = _pipelining.get(loop)
    if found is None:
        found = _pipelining[loop] = _Pipelining()
    return found


class Batch:
    """Commands and scripts sent in one round trip (a pipeline, no transaction). Queue
    with ``script()`` or any Redis command; ``execute()`` returns their results in order."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.then: list[tuple[int, Callable[[Any], Awaitable[None]]]] = []

    def script(
        self,
        script: Script,
        keys: list[str],
        args: list[Any],
        *,
        then: Callable[[Any], Awaitable[None]] | None = None,
    ) -> None:
        """Queue ``script``; ``then`` is awaited with its result once the batch has run (when
        the script ran: another command's failure does not stop it). It must not raise."""
        if then is not None:
            self.then.append((len(self.ops), then))
        # As a raw command: redis-py's cluster pipeline refuses its ``evalsha`` method.
        self.ops.append(
            ("execute_command", ("EVALSHA", script.sha, len(keys), *keys, *args), {}, script)
        )

    def __getattr__(self, command: str) -> Any:
        def queue(*args: Any, **kwargs: Any) -> None:
            self.ops.append((command, args, kwargs, None))

        return queue

    async def _send(self, indexes: list[int]) -> list[Any]:
        ops = [self.ops[i] for i in indexes]
        if isinstance(redis_async(), RedisCluster):
            return await _pipeline(ops)
        return await _pipelining_here().send(ops)

    async def execute(self, *, raise_errors: bool = True) -> list[Any]:
        """Every command's result, in order; the first error raised (after the ``then``
        of the scripts that ran), or left in its place with ``raise_errors=False``."""
        everything = list(range(len(self.ops)))
        results = await self._send(everything)
        lost = [i for i in everything if isinstance(results[i], NoScriptError)]
        if lost:
            # Redis restarted since these were loaded: the other commands ran; load the
            # scripts and run exactly the ones that did not.
            client = redis_async()
            for script in {self.ops[i][3] for i in lost} - {None}:
                await client.script_load(script.source)  # type: ignore[union-attr]
            for i, result in zip(lost, await self._send(lost), strict=True):
                results[i] = result
        # What a command that ran hands on is handed on even when another failed.
        for i, then in self.then:
            if not isinstance(results[i], Exception):
                await then(results[i])
        for result in results:
            if raise_errors and isinstance(result, Exception):
                raise result
        return results
