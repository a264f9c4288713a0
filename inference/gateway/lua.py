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
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

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


class Batch:
    """Commands and scripts sent in one round trip (a pipeline, no transaction). Queue
    with ``script()`` or any Redis command; ``execute()`` returns their results in order."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, tuple[Any, ...], dict[str, Any], Script | None]] = []
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
        # (A new cluster client learns its nodes first: ``client_ready``.)
        pipe = (await client_ready(redis_async())).pipeline(transaction=False)
        for i in indexes:
            command, args, kwargs, _ = self.ops[i]
            getattr(pipe, command)(*args, **kwargs)
        # Errors are raised below, after the ``then`` of the scripts that ran. (On a
        # cluster the pipeline is sent once, never retried: ``redis._SentOnce``.)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        return results

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
