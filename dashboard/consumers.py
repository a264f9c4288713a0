"""The operator page's live part over Channels: the pools-and-queues table, pushed as HTML
whenever it changes (checked every PUSH_SECONDS), to platform staff only."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.db import close_old_connections
from django.template.loader import render_to_string

from dashboard import selectors

PUSH_SECONDS = 1.0


def _render_ops() -> str:
    close_old_connections()
    try:
        return render_to_string("dashboard/_ops.html", selectors.ops_snapshot())
    finally:
        close_old_connections()


class OpsConsumer(AsyncWebsocketConsumer):
    channel_layer_alias = "__none__"

    async def connect(self) -> None:
        user = self.scope.get("user")
        self.pusher: asyncio.Task[None] | None = None
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=4403)
            return
        await self.accept()
        self.pusher = asyncio.create_task(self.push())

    async def disconnect(self, code: int) -> None:
        if self.pusher is not None:
            self.pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.pusher

    async def push(self) -> None:
        last = ""
        while True:
            html = await sync_to_async(_render_ops)()
            if html != last:
                await self.send(text_data=html)
                last = html
            await asyncio.sleep(PUSH_SECONDS)

    async def receive(self, text_data: str | None = None, bytes_data: Any = None) -> None:
        return  # nothing to say: the page only listens
