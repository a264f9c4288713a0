"""The operator page's live part over Channels: the pools-and-queues table, pushed as HTML
whenever it changes (checked every PUSH_SECONDS), to platform staff only.

Staff is checked at connect and again before every push: a socket outlives the session it
was opened with, so one whose session ended (logged out, flushed, password changed) or
whose user lost staff rights, was deactivated or deleted is closed (4403) within a tick.
"""

from __future__ import annotations

import asyncio
import contextlib
from importlib import import_module
from typing import Any

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.contrib import auth
from django.db import close_old_connections
from django.http import HttpRequest
from django.template.loader import render_to_string

from dashboard import selectors

PUSH_SECONDS = 1.0


def _still_staff(session_key: str | None, user_id: int) -> bool:
    """Whether the socket's session still logs in ``user_id`` as active staff, read afresh
    from the session store and the database (what Django's ``get_user`` checks per request:
    the session exists, names a configured backend, and its hash matches the password)."""
    if not session_key:
        return False
    engine = import_module(settings.SESSION_ENGINE)
    request = HttpRequest()
    request.session = engine.SessionStore(session_key=session_key)
    user = auth.get_user(request)
    return bool(user.is_authenticated and user.pk == user_id and user.is_active and user.is_staff)


def _render_ops(session_key: str | None, user_id: int) -> str | None:
    """The table, or None when the socket's user may no longer see it."""
    close_old_connections()
    try:
        if not _still_staff(session_key, user_id):
            return None
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
        session = self.scope.get("session")
        self.session_key: str | None = getattr(session, "session_key", None)
        self.user_id: int = user.pk
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
            html = await sync_to_async(_render_ops)(self.session_key, self.user_id)
            if html is None:
                await self.close(code=4403)
                return
            if html != last:
                await self.send(text_data=html)
                last = html
            await asyncio.sleep(PUSH_SECONDS)

    async def receive(self, text_data: str | None = None, bytes_data: Any = None) -> None:
        return  # nothing to say: the page only listens
