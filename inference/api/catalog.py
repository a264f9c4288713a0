"""This process's copy of the serving catalog, kept fresh from Redis in the background
(never per request), decoded into ``contract.Catalog``: the catalog's version counter is
polled four times a second and the snapshot fetched only when it moved, so a change (a
canary's weights, a replica drained) reaches every process within a quarter of a second.
When Redis has lost it, or holds one this process cannot read (a publisher of another
version), it is rebuilt from Postgres."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from redis.exceptions import RedisError

from contract import Catalog, catalog_decoder
from inference.api.db import run_db
from inference.api.redis import redis_async
from inference.catalog import CATALOG_KEY, CATALOG_VERSION_KEY, catalog_publish

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # how often the version is read
# The snapshot is fetched at least this often anyway; and every second while Redis holds
# no version (a snapshot written by something other than catalog_publish).
FULL_SECONDS = 30.0
UNVERSIONED_SECONDS = 1.0


class CatalogView:
    def __init__(self) -> None:
        self.data: Catalog | None = None
        self.version: object = None  # the version counter the data came with
        self.fetched = 0.0
        self.task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> Catalog:
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._refresh_forever())
        if self.data is None:
            await self.refresh()
        if self.data is None:  # refresh() always sets it; this keeps the type checker honest
            raise RuntimeError("serving catalog unavailable")
        return self.data

    async def refresh(self, *, republish: bool = False) -> None:
        async with self._lock:
            raw = version = None
            if not republish:
                version, raw = await redis_async().mget(CATALOG_VERSION_KEY, CATALOG_KEY)
            data = None
            if raw is not None:
                try:
                    data = catalog_decoder.decode(raw)
                except msgspec.DecodeError:
                    log.warning("serving catalog in Redis unreadable: rebuilding it", exc_info=True)
            if data is None:
                if raw is None:
                    log.info("serving catalog missing in Redis: publishing it from the database")
                data = await run_db(catalog_publish)
                version = await redis_async().get(CATALOG_VERSION_KEY)
            self.data, self.version = data, version
            self.fetched = time.monotonic()

    async def _stale(self) -> bool:
        version = await redis_async().get(CATALOG_VERSION_KEY)
        age = time.monotonic() - self.fetched
        if version is None:
            return age >= UNVERSIONED_SECONDS
        return version != self.version or age >= FULL_SECONDS

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            try:
                if await self._stale():
                    await self.refresh()
            except (RedisError, OSError):
                log.warning("could not refresh the serving catalog", exc_info=True)
            except Exception:  # the database may be away; keep serving from the last copy
                log.warning("could not rebuild the serving catalog", exc_info=True)


_views: dict[asyncio.AbstractEventLoop, CatalogView] = {}


def catalog_view() -> CatalogView:
    loop = asyncio.get_running_loop()
    view = _views.get(loop)
    if view is None:
        view = _views[loop] = CatalogView()
    return view
