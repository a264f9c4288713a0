"""The limits script on real Redis (and the ledger in Postgres for the monthly counters),
driven the way concurrent requests drive it: many acquisitions in flight at once."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from asgiref.sync import sync_to_async

from inference.gateway import limits
from inference.gateway.auth import KeyInfo, key_info_from_db
from inference.gateway.errors import ApiError
from inference.gateway.redis import redis_async
from tenants.keys import LEGACY_LAST_USED_KEY, last_used_key
from tenants.models import ApiKey
from tenants.services import api_key_create, api_keys_last_used_flush, tenant_create

pytestmark = pytest.mark.django_db(transaction=True)


def _key(**tenant_limits: int) -> KeyInfo:
    tenant = tenant_create(slug=f"lim-{uuid.uuid4().hex[:8]}", limits=tenant_limits, actor=None)
    issued = api_key_create(tenant=tenant, name="k", created_by=None)
    info = key_info_from_db(issued.api_key.prefix)
    assert info is not None
    return info


async def _outcomes(key: KeyInfo, n: int, **kwargs: int) -> list[limits.Grant | ApiError]:
    async def one() -> limits.Grant | ApiError:
        try:
            return await limits.acquire(key, rid=uuid.uuid4().hex, **kwargs)
        except ApiError as error:
            return error

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def test_concurrent_requests_cannot_all_pass_a_nearly_spent_token_budget() -> None:
    """Twenty requests at once, each of which may use 300 tokens, against 1,000 left: the
    estimate is reserved as each passes, so only as many pass as the budget can hold (before
    the fix all twenty passed and the budget was overshot six times)."""
    key = await sync_to_async(_key)(monthly_token_budget=1000)
    outcomes = await _outcomes(key, 20, estimate=300)
    granted = [o for o in outcomes if isinstance(o, limits.Grant)]
    refused = [o for o in outcomes if isinstance(o, ApiError)]
    assert len(granted) == 4  # 0, 300, 600, 900 reserved: each still under 1,000
    assert {e.code for e in refused} == {"insufficient_quota"}
    # What they did not use comes back: after they finish with 50 tokens each, the budget
    # holds 800 more, and two requests of 300 pass again.
    for grant in granted:
        await grant.release(50)
    again = await _outcomes(key, 5, estimate=300)
    assert sum(isinstance(o, limits.Grant) for o in again) == 3  # 200, 500, 800 used + held


async def test_concurrent_requests_cannot_overshoot_the_spend_budget() -> None:
    key = await sync_to_async(_key)(monthly_spend_budget_micros=10_000)
    outcomes = await _outcomes(key, 10, estimate=10, estimated_cost=3_000)
    assert sum(isinstance(o, limits.Grant) for o in outcomes) == 4  # 0, 3k, 6k, 9k < 10k


async def test_concurrency_counts_sequences() -> None:
    key = await sync_to_async(_key)(max_concurrency=4)
    first = await limits.acquire(key, rid="a", estimate=10, sequences=3)
    with pytest.raises(ApiError) as err:  # 3 + 3 > 4
        await limits.acquire(key, rid="b", estimate=10, sequences=3)
    assert err.value.status == 429 and err.value.code == "rate_limit_exceeded"
    single = await limits.acquire(key, rid="c", estimate=10)  # 3 + 1 fits
    with pytest.raises(ApiError) as err:  # larger than the limit itself: can never run
        await limits.acquire(key, rid="d", estimate=10, sequences=5)
    assert err.value.status == 400 and "5 sequences" in err.value.message
    await first.release(10)
    await single.release(10)
    await limits.acquire(key, rid="e", estimate=10, sequences=4)


async def test_a_crashed_requests_reservation_expires_with_its_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = await sync_to_async(_key)(monthly_token_budget=1000)
    monkeypatch.setattr(limits, "LEASE_MS", 300)
    await limits.acquire(key, rid="lost", estimate=1000)  # never released: its process died
    with pytest.raises(ApiError):
        await limits.acquire(key, rid="next", estimate=900)
    await asyncio.sleep(0.4)
    await limits.acquire(key, rid="later", estimate=900)


async def test_a_keys_last_use_reaches_its_row_and_a_failed_end_does_not_lose_it() -> None:
    """ACQUIRE stamps the key's last use in its tenant's hash; each request's end names the
    tenant to the flush, so a request whose end never came (its process died) is flushed
    with the tenant's next one."""
    key = await sync_to_async(_key)()
    await limits.acquire(key, rid=uuid.uuid4().hex, estimate=10)  # its end never comes
    assert await sync_to_async(api_keys_last_used_flush)() == 0  # nobody named the tenant
    grant = await limits.acquire(key, rid=uuid.uuid4().hex, estimate=10)
    await grant.release(5)
    assert await sync_to_async(api_keys_last_used_flush)() == 1
    assert (await ApiKey.objects.aget(prefix=key.prefix)).last_used_at is not None
    assert await redis_async().exists(last_used_key(key.tenant_id)) == 0
    assert await sync_to_async(api_keys_last_used_flush)() == 0  # nothing twice


@pytest.mark.single_redis
async def test_the_last_use_an_older_version_stamped_is_flushed_too() -> None:
    """The one hash of the versions before the per-tenant ones (an upgrade's leftovers)."""
    key = await sync_to_async(_key)()
    await redis_async().hset(LEGACY_LAST_USED_KEY, key.prefix, int(time.time()))
    assert await sync_to_async(api_keys_last_used_flush)() == 1
    assert (await ApiKey.objects.aget(prefix=key.prefix)).last_used_at is not None
    assert await redis_async().exists(LEGACY_LAST_USED_KEY) == 0
