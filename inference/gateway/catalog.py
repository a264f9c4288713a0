"""This process's copy of the serving catalog, kept fresh from Redis in the background
(never per request), decoded into ``contract.Catalog``. ``catalog_publish`` announces each
change on ``ip:catalog:changed:db<N>``; the process, subscribed (``inference.gateway.watch``), then
compares the version counter and the snapshot's digest (the counter starts again at 1 when
Redis loses it) and fetches the snapshot only when one moved. So a change (a
canary's weights, a replica drained) reaches every process within milliseconds, and an idle
platform costs a process nothing between changes (one look at the version a minute).
Each process counts itself among those that applied an announced version
(``catalog_applied`` waits for them all). When Redis has lost it, or holds one this process
cannot read (a publisher of another version), it is rebuilt from Postgres."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from redis.exceptions import RedisError

from contract import Catalog, CatalogAdapter, catalog_decoder
from inference.catalog import (
    ADAPTERS_KEY,
    ADAPTERS_SERIAL_KEY,
    CATALOG_CHANNEL,
    CATALOG_DIGEST_KEY,
    CATALOG_KEY,
    CATALOG_TAG,
    CATALOG_VERSION_KEY,
    adapters_part_decoder,
    catalog_publish,
)
from inference.gateway.db import run_db
from inference.gateway.redis import redis_async
from inference.gateway.watch import watch_forever

log = logging.getLogger(__name__)

# Without a message, the version is looked at this often anyway (a subscription that died
# without a word); and every second while Redis holds no version (a snapshot written by
# something other than catalog_publish), when the snapshot is fetched each time.
QUIET_SECONDS = 60.0
UNVERSIONED_SECONDS = 1.0


class CatalogView:
    """The snapshot (``data``: models, pools, routes; no adapters) and, per tenant that has
    called, its adapters' part; ``for_tenant`` is the catalog as that tenant sees it."""

    def __init__(self) -> None:
        self.data: Catalog | None = None
        self.version: object = None  # the version counter the data came with
        # ... and the snapshot's digest: the counter starts again at 1 when Redis loses it
        # (a flush, a restart without persistence), so a number alone can name two snapshots.
        self.digest: object = None
        self.serial: int | None = None  # the adapters' serial the parts are as of
        self.parts: dict[int, dict[str, CatalogAdapter]] = {}  # tenant -> its adapters
        self.merged: dict[int, Catalog] = {}  # tenant -> data with its adapters in it
        self.generation = 0  # moves whenever parts are dropped: a fetch under way is stale
        self.task: asyncio.Task[None] | None = None
        self.resumed: asyncio.Task[None] | None = None  # the first look of a watch restarted
        self._lock = asyncio.Lock()

    async def get(self) -> Catalog:
        if self.task is None or self.task.done():
            listened = self.task is not None
            self.task = asyncio.create_task(self._refresh_forever())
            if listened and self.data is not None:  # what changed while no one listened
                self.resumed = asyncio.create_task(self._catch_up())
        if self.resumed is not None and not self.resumed.done():
            await asyncio.shield(self.resumed)  # every caller meanwhile, not only the first
        if self.data is None:
            await self.refresh()
        if self.data is None:  # refresh() always sets it; this keeps the type checker honest
            raise RuntimeError("serving catalog unavailable")
        return self.data

    async def for_tenant(self, tenant_id: int) -> Catalog:
        """The catalog with the tenant's own adapters in it: fetched (one ``HGET``) the
        first time the tenant calls, and again only after its part changed."""
        data = await self.get()
        found = self.merged.get(tenant_id)
        if found is not None and found.version == data.version:
            return found
        adapters = self.parts.get(tenant_id)
        if adapters is None:
            generation = self.generation
            try:
                raw = await redis_async().hget(ADAPTERS_KEY, str(tenant_id))
            except RedisError:  # the request's own Redis calls will say so; serve the base
                log.warning("could not read tenant %s's adapters", tenant_id, exc_info=True)
                return data
            adapters = adapters_part_decoder.decode(raw or b"{}")
            if generation != self.generation:
                return msgspec.structs.replace(data, adapters=adapters) if adapters else data
            self.parts[tenant_id] = adapters
        found = msgspec.structs.replace(data, adapters=adapters) if adapters else data
        if data is self.data:
            self.merged[tenant_id] = found
        return found

    async def _catch_up(self) -> None:
        try:
            await self._look([])
        except Exception:  # the database may be away too: serve from the last copy
            log.warning("could not look at the serving catalog's version", exc_info=True)

    def _drop(self, tenants: list[int] | None) -> None:
        self.generation += 1
        if tenants is None:
            self.parts.clear()
            self.merged.clear()
        else:
            for tenant in tenants:
                self.parts.pop(tenant, None)
                self.merged.pop(tenant, None)

    async def refresh(self, *, republish: bool = False) -> None:
        async with self._lock:
            raw = version = serial = digest = None
            if not republish:
                version, raw, serial, digest = await redis_async().mget(
                    CATALOG_VERSION_KEY, CATALOG_KEY, ADAPTERS_SERIAL_KEY, CATALOG_DIGEST_KEY
                )
            if self.serial is None and serial:
                self.serial = int(serial)  # parts fetched from now on are at least as new
            data = None
            if raw is not None:
                try:
                    data = catalog_decoder.decode(raw)
                except msgspec.DecodeError:
                    log.warning("serving catalog in Redis unreadable: rebuilding it", exc_info=True)
            if data is None:
                if raw is None:
                    log.info("serving catalog missing in Redis: publishing it from the database")
                # (forced when unreadable: the snapshot may be as new as ours)
                published = await run_db(catalog_publish, force=raw is not None)
                data = msgspec.structs.replace(published, adapters={})
                version, digest = await redis_async().mget(CATALOG_VERSION_KEY, CATALOG_DIGEST_KEY)
                self._drop(None)
            self.data, self.version, self.digest = data, version, digest

    def _announced(self, message: bytes) -> bool:
        """A message about the adapters' parts, applied; False for anything else."""
        kind, _, rest = message.decode(errors="replace").partition(":")
        if kind != "a":
            return False
        serial, _, which = rest.partition(":")
        if not serial.isdigit():
            return True
        consecutive = self.serial is not None and int(serial) == self.serial + 1
        if which == "*" or not consecutive:  # all, or a message was missed: drop them all
            self._drop(None)
        else:
            self._drop([int(t) for t in which.split(",") if t.isdigit()])
        self.serial = int(serial)
        return True

    async def _look(self, messages: list[bytes]) -> None:
        snapshot = not messages  # a look without messages checks both
        for message in messages:
            if not self._announced(message):
                snapshot = True
        if not snapshot:
            return
        version, raw, digest = await redis_async().mget(
            CATALOG_VERSION_KEY, ADAPTERS_SERIAL_KEY, CATALOG_DIGEST_KEY
        )
        serial = int(raw) if raw else None
        if serial != self.serial:  # moved unannounced (or first look): every part again
            self._drop(None)
            self.serial = serial
        if version is None or version != self.version or digest != self.digest:
            await self.refresh()

    def _quiet(self) -> float:
        return UNVERSIONED_SECONDS if self.version is None else QUIET_SECONDS

    async def _refresh_forever(self) -> None:
        await watch_forever(
            CATALOG_CHANNEL,
            self._look,
            quiet_seconds=self._quiet,
            what="the serving catalog",
            tag=CATALOG_TAG,
        )


_views: dict[asyncio.AbstractEventLoop, CatalogView] = {}


def catalog_view() -> CatalogView:
    loop = asyncio.get_running_loop()
    view = _views.get(loop)
    if view is None:
        view = _views[loop] = CatalogView()
    return view
