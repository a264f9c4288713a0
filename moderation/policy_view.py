"""Each web process's copy of the moderation policies (``policy_view()``, one per event loop),
refreshed when a publish announces a change (``moderation.publishing``)."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import msgspec

from inference.gateway.db import run_db
from inference.gateway.redis import redis_async
from inference.gateway.watch import watch_forever
from moderation import classifier
from moderation.cascade import Cascade
from moderation.policy import Snapshot, snapshot_decoder
from moderation.publishing import CHANNEL, POLICIES_KEY, TAG, VERSION_KEY, policies_publish

log = logging.getLogger(__name__)

QUIET_SECONDS = 60.0  # a look at the version without being told (inference.gateway.watch)


class PolicyView:
    """This process's policies, refreshed in the background when a publish announces a
    change (``inference.gateway.watch``): one ``GET`` of the version, the snapshot fetched only
    when it changed; rebuilt from Postgres when Redis has none. Compiled cascades are kept
    per (tenant, policy version)."""

    def __init__(self) -> None:
        self.version: bytes | None = None
        self.policies: Snapshot | None = None
        self.cascades: dict[int, Cascade] = {}
        self.task: asyncio.Task[None] | None = None
        self.resumed: asyncio.Task[None] | None = None  # the first look of a watch restarted
        self._lock = asyncio.Lock()

    async def get(self) -> Snapshot:
        if self.task is None or self.task.done():
            listened = self.task is not None
            self.task = asyncio.create_task(self._refresh_forever())
            if listened and self.policies is not None:  # what changed while no one listened
                self.resumed = asyncio.create_task(self._catch_up())
        if self.resumed is not None and not self.resumed.done():
            await asyncio.shield(self.resumed)  # every caller meanwhile, not only the first
        if self.policies is None:
            await self.refresh()
        return self.policies or {}

    async def _catch_up(self) -> None:
        try:
            await self.refresh()
        except Exception:  # the database may be away too: serve from the last copy
            log.warning("could not look at the moderation policies", exc_info=True)

    async def cascade(self, tenant_id: int) -> Cascade | None:
        spec = (await self.get()).get(tenant_id)
        if spec is None:
            return None
        found = self.cascades.get(tenant_id)
        if found is None or found.spec.version != spec.version:  # compiled once a version
            found = self.cascades[tenant_id] = Cascade(tenant_id, spec)
        return found

    async def refresh(self) -> None:
        async with self._lock:
            client = redis_async()
            version = cast(bytes | None, await client.get(VERSION_KEY))
            if version is not None and version == self.version and self.policies is not None:
                return
            raw = await client.get(POLICIES_KEY) if version is not None else None
            policies: Snapshot | None = None
            if raw is not None:
                try:
                    policies = snapshot_decoder.decode(raw)
                except msgspec.DecodeError:
                    log.warning("moderation policies in Redis unreadable: republishing them")
            if policies is None:
                number, rebuilt = await run_db(policies_publish)
                policies, version = rebuilt, str(number).encode()
            known: Snapshot = policies
            self.version, self.policies = version, known
            self.cascades = {t: c for t, c in self.cascades.items() if t in known}
            if any(spec.classifier for spec in known.values()) and not classifier.loaded():
                # Load the embedded classifier now, off the loop, not in a request's budget.
                asyncio.get_running_loop().run_in_executor(None, classifier.classifier)

    async def _refresh_forever(self) -> None:
        await watch_forever(
            CHANNEL,
            lambda _messages: self.refresh(),
            quiet_seconds=lambda: QUIET_SECONDS,
            what="the moderation policies",
            tag=TAG,
        )


_views: dict[asyncio.AbstractEventLoop, PolicyView] = {}


def policy_view() -> PolicyView:
    loop = asyncio.get_running_loop()
    view = _views.get(loop)
    if view is None:
        view = _views[loop] = PolicyView()
    return view
