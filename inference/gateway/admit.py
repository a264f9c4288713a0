"""Admitting a prepared request to a replica (``prepare``'s last step): the limits taken and
a place in the pool's fair admission asked for in one round trip, lent room for a batch line,
and giving back what was held when the request goes no further."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from contract import CatalogPool
from inference.gateway import lending, limits
from inference.gateway.admission import CatalogMissing, NotTaken, admission
from inference.gateway.auth import KeyInfo
from inference.gateway.call import Adapter
from inference.gateway.errors import overloaded
from inference.gateway.schema import ParsedRequest
from tenants.priority import band

log = logging.getLogger(__name__)


async def take_and_admit(
    view: Any,
    pool_name: str,
    pool: CatalogPool,
    planned: limits.Plan,
    key: KeyInfo,
    parsed: ParsedRequest,
    adapter: Adapter | None,
    prefix: str,
    priority: str,
) -> tuple[limits.Grant, str]:
    """The limits taken and a replica admitted to, ACQUIRE sent beside ENQUEUE in one
    round trip. When the limits refuse, admission's part is undone (``Admission.admit``)
    and the refusal is decided as it would have been alone (a 429, or a monthly counter
    seeded and the request admitted after)."""
    try:
        replica = await admit_to(
            view, pool_name, pool, planned.rid, key, parsed, planned, adapter, prefix, priority,
            alongside=planned,
        )  # fmt: skip
    except NotTaken as refused:
        if isinstance(refused.result, Exception):
            raise refused.result from None
        grant = await limits.decide(planned, refused.result)  # a 429 is raised here
        try:
            replica = await admit_to(
                view, pool_name, pool, planned.rid, key, parsed, grant, adapter, prefix, priority
            )
        except BaseException:
            await asyncio.shield(release_quietly(grant))
            raise
        return grant, replica
    except BaseException:
        if planned.result is not None and planned.taken(planned.result):
            await asyncio.shield(release_quietly(planned.grant()))
        raise
    return planned.grant(), replica


async def borrow_or_admit(
    view: Any,
    pool_name: str,
    pool: CatalogPool,
    lend: str,
    lender: CatalogPool,
    lend_open: Callable[[], bool],
    rid: str,
    key: KeyInfo,
    parsed: ParsedRequest,
    grant: limits.Grant,
    adapter: Adapter | None,
    prefix: str,
    priority: str,
) -> tuple[str, bool]:
    """A batch line offered room by a lending pool (``prepare``'s ``lend``): room lent now,
    else a place in its own pool's queue that it leaves for lent room coming first
    (``lending.queue_or_borrow``) — or, with no pool of its own to wait in, lent room asked
    for every ``BORROW_EVERY`` up to the lender's queue wait (a 503 after it). Returns (the
    replica, whether it is lent room)."""

    def borrow() -> Awaitable[str]:
        return lending.borrow(lend, rid, key, parsed, grant, adapter, prefix)

    replica = await borrow()
    if replica:
        return replica, True
    if lend == pool_name:
        deadline = time.monotonic() + lender.max_queue_wait_seconds
        while time.monotonic() < deadline:
            await asyncio.sleep(lending.BORROW_EVERY)
            if replica := await borrow():
                return replica, True
        raise overloaded(2, f"Pool `{lend}` had no room to lend.")
    deadline = time.monotonic() + pool.max_queue_wait_seconds

    def leave_queue() -> Awaitable[None]:
        return admission().complete(pool=pool_name, rid=rid, adjustment=0)

    return await lending.queue_or_borrow(
        lambda: admit_to(
            view,
            pool_name,
            pool,
            rid,
            key,
            parsed,
            grant,
            adapter,
            prefix,
            priority,
            wait=max(1.0, deadline - time.monotonic()),
        ),
        borrow,
        lambda: lending.lendable(lend, parsed, adapter, prefix),
        leave_queue,
        deadline=deadline,
        may_ask=lend_open,
    )


async def admit_to(
    view: Any,
    pool_name: str,
    pool: CatalogPool,
    rid: str,
    key: KeyInfo,
    parsed: ParsedRequest,
    grant: limits.Grant | limits.Plan,
    adapter: Adapter | None,
    prefix: str,
    priority: str,
    wait: float | None = None,
    alongside: limits.Plan | None = None,
) -> str:
    """Admitted to a replica of the pool, in the band of its ``priority`` class; ``prefix``:
    the request's salted prefix hash, for prefix-affine routing within the tenant's own cache
    partition. It waits ``wait`` seconds at most (the pool's queue wait by default)."""
    for attempt in range(2):
        try:
            return await admission().admit(
                pool=pool_name,
                rid=rid,
                tenant=key.tenant_id,
                weight=key.weight,
                prompt_estimate=parsed.prompt_estimate,
                prefix=prefix,
                wait_seconds=pool.max_queue_wait_seconds if wait is None else wait,
                limit_keys=grant.conc_keys,
                limit_member=grant.member,
                adapter=adapter.engine_name if adapter else "",
                sequences=parsed.sequences,
                band=band(priority),
                # Sent once: a retry after a republish has the limits taken already.
                alongside=alongside if alongside is not None and alongside.result is None else None,
            )
        except CatalogMissing:
            if attempt:
                break
            await view.refresh(republish=True)
        except RedisError:
            log.warning("admission unavailable", exc_info=True)
            break
    raise overloaded(2, "Admission is unavailable for a moment. Retry shortly.")


async def give_back(pool: str, rid: str, grant: limits.Grant) -> None:
    try:
        await admission().complete(pool=pool, rid=rid, adjustment=0)
    except RedisError:
        log.warning("could not give back the slot of %s", rid, exc_info=True)
    await release_quietly(grant)


async def release_quietly(grant: limits.Grant) -> None:
    try:
        await grant.release(0)
    except RedisError:
        log.warning("could not release limits of %s", grant.rid, exc_info=True)
