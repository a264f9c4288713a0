"""Stopping an answer nobody will read (the client left, or a filter cut it): the engine is
asked to abort the call's sequences, and what it generated is still read, so the ledger holds
the engine's own count.

The engine is asked to abort by the request ids the gateway gave it (vLLM's
``abort_requests``); it then ends each sequence with ``finish_reason: "abort"`` and sends the
usage of all it generated, which is read to the ``[DONE]`` (within ``ABORTED_CAP_SECONDS``).
An engine that does not take the abort (one started without ``--enable-scale-out``) is read
while data keeps coming without a pause of ``DRAIN_IDLE_SECONDS`` (up to
``DRAIN_CAP_SECONDS``), then closed, which aborts it: then the steps it was running when the
connection closed are not billed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import orjson

from inference.engine_auth import engine_auth_headers
from inference.gateway.call import Call
from inference.gateway.upstream import (
    ABORT_PATH,
    TRANSPORT_ERRORS,
    SseBatches,
    Stalled,
    engine_request_ids,
    engine_session,
)

DRAIN_IDLE_SECONDS = 0.05
DRAIN_CAP_SECONDS = 0.25
# After the engine took an abort: its last events (each sequence's finish_reason "abort",
# then the usage of all it generated) come within milliseconds. A pause of ABORTED_IDLE
# means it is not stopping them (ids it did not know: vLLM answers 200 to any), and the
# connection is closed, which aborts them; the whole wait is bounded by ABORTED_CAP.
ABORTED_IDLE_SECONDS = 1.0
ABORTED_CAP_SECONDS = 5.0
ABORT_ASK_SECONDS = 1.0


async def abort_and_count(
    call: Call, batches: SseBatches, first: list[bytes] | None, count: Callable[[list[bytes]], bool]
) -> bool:
    """Abort ``call`` on its engine and ``count`` what is left of its stream (``first``: an
    event read but never relayed); True when the stream was read to its ``[DONE]``."""
    try:
        if first is not None and count(first):
            return True
        idle, cap = DRAIN_IDLE_SECONDS, DRAIN_CAP_SECONDS
        if await _abort(call):
            idle, cap = ABORTED_IDLE_SECONDS, ABORTED_CAP_SECONDS
        deadline = time.perf_counter() + cap
        while (remaining := deadline - time.perf_counter()) > 0:
            batch = await asyncio.wait_for(anext(batches), timeout=min(idle, remaining))
            if count(batch):
                return True
    except (
        TimeoutError,
        StopAsyncIteration,
        Stalled,
        *TRANSPORT_ERRORS,
        orjson.JSONDecodeError,
    ):
        pass
    return False


async def _abort(call: Call) -> bool:
    """Ask the engine to abort the call's sequences; True if it took the request."""
    ids = engine_request_ids(
        endpoint=call.parsed.endpoint, rid=call.rid, prompts=call.parsed.prompts
    )
    try:
        async with (
            asyncio.timeout(ABORT_ASK_SECONDS),
            engine_session().post(
                call.route.replica_url + ABORT_PATH,
                json={"request_ids": ids},
                headers=engine_auth_headers(),
            ) as response,
        ):
            await response.read()
            return response.status == 200
    except (*TRANSPORT_ERRORS, TimeoutError):
        return False
