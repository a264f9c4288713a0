"""A batch line's lent room (docs/priority.md, "Lending idle online room to batch work"):
borrowed at once or not at all (``Admission.borrow``), and, for a line that waits in its own
pool's queue, taken when the lending pool has some before that queue admits it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from inference.gateway import limits
from inference.gateway.admission import CatalogMissing, admission
from inference.gateway.auth import KeyInfo
from inference.gateway.call import Adapter
from inference.gateway.schema import ParsedRequest

log = logging.getLogger(__name__)

BORROW_EVERY = 0.5  # how often a line waiting for lent room asks for it


async def queue_or_borrow(
    admit: Callable[[], Awaitable[str]],
    borrow: Callable[[], Awaitable[str]],
    lendable: Callable[[], Awaitable[bool]],
    give_back: Callable[[], Awaitable[None]],
    *,
    deadline: float,
    may_ask: Callable[[], bool],
) -> tuple[str, bool]:
    """A batch line waits in its own pool's queue (``admit``) and leaves it for lent room
    when the lending pool has some first (``lendable``, asked every ``BORROW_EVERY`` while
    ``may_ask``, until ``deadline``: then the queue's own wait decides): room an online pool
    lends later is not left idle while lines wait for a spot replica. It leaves the queue
    before it borrows, so it is never admitted twice: a spot grant that came before it left
    is kept, one that raced its leaving is given back (``Admission.admit``), and a line
    that then finds the lent room gone joins the queue again. Cancelled, it holds nothing
    (``give_back``: the spot slot, if granted meanwhile). Returns (the replica, whether it
    is lent room)."""
    while True:
        queued = asyncio.ensure_future(admit())
        try:
            await _until_lendable(queued, lendable, deadline, may_ask)
            if not queued.done():  # out of the queue (``Admission.admit`` undoes its part)
                queued.cancel()
                await asyncio.wait((queued,))
        except BaseException:
            await asyncio.shield(_abandon(queued, give_back))
            raise
        if not queued.cancelled():
            return queued.result(), False  # admitted first (or refused: its error)
        replica = await borrow()
        if replica:
            return replica, True
        # Another took the room between the two asks: back to the queue.


async def _until_lendable(
    queued: asyncio.Future[str],
    lendable: Callable[[], Awaitable[bool]],
    deadline: float,
    may_ask: Callable[[], bool],
) -> None:
    """Until ``queued`` ends, or the lending pool has room. The asks are spread (lines
    waiting side by side do not all ask at the same moment) and stop at ``deadline``."""
    while not queued.done():
        if time.monotonic() >= deadline:
            await asyncio.wait((queued,))  # its own wait ends it
            return
        await asyncio.wait((queued,), timeout=BORROW_EVERY * random.uniform(0.8, 1.2))  # noqa: S311
        if not queued.done() and may_ask() and await lendable():
            return


async def _abandon(queued: asyncio.Future[str], give_back: Callable[[], Awaitable[None]]) -> None:
    """The caller is gone: out of the queue, and a slot granted meanwhile given back."""
    if not queued.done():
        queued.cancel()
    await asyncio.wait((queued,))
    if not queued.cancelled() and queued.exception() is None:
        with contextlib.suppress(RedisError):  # else its lease frees it
            await give_back()


async def lendable(pool: str, parsed: ParsedRequest, adapter: Adapter | None, prefix: str) -> bool:
    try:
        return await admission().lendable(
            pool=pool,
            prefix=prefix,
            adapter=adapter.engine_name if adapter else "",
            sequences=parsed.sequences,
        )
    except (CatalogMissing, RedisError):
        return False  # it keeps its place in its own pool's queue


async def borrow(
    pool: str,
    rid: str,
    key: KeyInfo,
    parsed: ParsedRequest,
    grant: limits.Grant,
    adapter: Adapter | None,
    prefix: str,
) -> str:
    """Room ``pool`` lends now (a replica), or "" (none, or admission unreachable: the
    line runs on its own pool instead)."""
    try:
        return await admission().borrow(
            pool=pool,
            rid=rid,
            tenant=key.tenant_id,
            weight=key.weight,
            prompt_estimate=parsed.prompt_estimate,
            prefix=prefix,
            limit_keys=grant.conc_keys,
            limit_member=grant.member,
            adapter=adapter.engine_name if adapter else "",
            sequences=parsed.sequences,
        )
    except (CatalogMissing, RedisError):
        log.warning("could not borrow room on %s", pool, exc_info=True)
        return ""
