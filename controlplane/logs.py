"""Logging: the request id on every line logged while a request is being served, and the
JSON formatter that ``INFERPLANE_LOG_FORMAT=json`` switches on (settings.LOGGING).

The id lives in a context variable: asyncio copies the context into every task a request's
code starts, so a line logged anywhere below it (admission, the relay, moderation, a
failover) carries the id that the response's ``x-request-id`` and the ledger carry.
"""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar
from typing import Any

import pythonjsonlogger.json
from pythonjsonlogger.core import RESERVED_ATTRS

request_id_var: ContextVar[str] = ContextVar("inferplane_request_id", default="")


def request_id_new() -> str:
    """A new request id, made the current one (for this task and the tasks it starts)."""
    rid = uuid.uuid4().hex
    request_id_var.set(rid)
    return rid


class RequestIdFilter(logging.Filter):
    """Puts ``request_id`` on every record (empty outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(pythonjsonlogger.json.JsonFormatter):
    """python-json-logger's formatter, less uvicorn's ``color_message`` (a copy of the
    message with terminal colour codes, which a log pipeline has no use for)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("reserved_attrs", [*RESERVED_ATTRS, "color_message"])
        super().__init__(*args, **kwargs)
