"""A request's life in the gateway, whatever carries it (SSE, JSON, WebSocket — and, with the
batch leg, a Celery worker): one object that owns it from the checked key to the ledger.

    life = await Lifecycle.begin(key=key, raw_body=body, endpoint="chat.completions")
    async with life:
        await life.relay.start()          # route, send; another replica if one fails first
        async for batch in life.relay:    # the engine's chunks, in OpenAI's shape
            ...                           # the transport writes them

``begin`` validates, resolves the model, takes the limits and waits for admission
(``pipeline.prepare``; an ``ApiError`` there leaves nothing held). Leaving the ``async with``,
however it is left — the answer complete, an error, the client gone (``ClientGone``) or the
task cancelled — closes the engine's stream (draining it first when the client left, so the
tokens made are counted), meters the call and frees its slot and limits, shielded from
cancellation, exactly once. The call's outcome is set only through ``Call.fail`` and
settled by ``pipeline.finish``.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from inference.api.auth import KeyInfo
from inference.api.pipeline import Call, Relay, finish, prepare


class ClientGone(Exception):
    """The client left while its request was answering (a closed WebSocket)."""


class Lifecycle:
    def __init__(self, call: Call) -> None:
        self.call = call
        self.relay = Relay(call)

    @classmethod
    async def begin(cls, *, key: KeyInfo, raw_body: bytes, endpoint: str) -> Lifecycle:
        return cls(await prepare(key=key, raw_body=raw_body, endpoint=endpoint))

    async def __aenter__(self) -> Lifecycle:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        gone = exc_type is not None and issubclass(exc_type, asyncio.CancelledError | ClientGone)
        await asyncio.shield(self._settle(cancelled=gone))

    async def _settle(self, *, cancelled: bool) -> None:
        if cancelled:
            await self.relay.drain()
        await self.relay.close()
        await finish(self.call, cancelled=cancelled)
