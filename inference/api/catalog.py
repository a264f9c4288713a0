"""This process's copy of the serving catalog, refreshed from Redis every second in the
background (never per request), decoded into ``contract.Catalog``. When Redis has lost it,
or holds one this process cannot read (a publisher of another version), it is rebuilt from
Postgres."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from redis.exceptions import RedisError

from contract import Catalog, catalog_decoder
from inference.api.db import run_db
from inference.api.redis import redis_async
from inference.catalog import CATALOG_KEY, catalog_publish

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0


class CatalogView:
    def __init__(self) -> None:
        self.data: Catalog | None = None
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
            raw = None if republish else await redis_async().get(CATALOG_KEY)
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
            self.data = data
            self.fetched = time.monotonic()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
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
