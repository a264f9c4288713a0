"""The hot path's rare database calls (a key's first look-up, a budget counter's seed, the
catalog rebuilt, a usage record Redis could not take), and the Responses API's stored
conversations, on executor threads.

Django checks a persistent connection's health, and drops a broken one, only at the edges of
a *request* (``close_old_connections``). Executor threads never see a request, so a
connection that died with its server (a PostgreSQL restart, a failover) would stay in its
thread for good and fail every later call there. Each call here is wrapped in those same
edges: before it, a connection that is broken or past ``CONN_MAX_AGE`` is closed and the next
query reconnects; after it, one that just failed is closed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.db import close_old_connections

# A few threads of this process's own, whatever event loops come and go: each keeps one
# connection (CONN_MAX_AGE), so a web process holds at most this many for the hot path.
DB_THREADS = 4
_executor = ThreadPoolExecutor(max_workers=DB_THREADS, thread_name_prefix="hot-path-db")


def _fresh[**P, T](fn: Callable[P, T]) -> Callable[P, T]:
    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return call


# The Responses API's stored conversations (read and written on every such request, and
# larger than a key): threads of their own, so that they never hold up a key's look-up.
CONVERSATION_THREADS = 4
_conversations = ThreadPoolExecutor(
    max_workers=CONVERSATION_THREADS, thread_name_prefix="conversations-db"
)


async def run_db[**P, T](fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` on one of this module's threads (never the event loop's, never the one
    thread that serves Django's synchronous views) with a healthy connection."""
    call = sync_to_async(_fresh(fn), thread_sensitive=False, executor=_executor)
    return await call(*args, **kwargs)


async def run_conversations_db[**P, T](fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``run_db`` for the stored conversations, on their own threads."""
    call = sync_to_async(_fresh(fn), thread_sensitive=False, executor=_conversations)
    return await call(*args, **kwargs)
