"""The async Redis client of this process (one per event loop), shared by the hot path."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import hiredis
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.cluster import PipelineStrategy, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError

from controlplane.redis import cluster_seed

# How long an admission listener with nobody waiting blocks on its grants list before it
# looks again (``inference.gateway.admission``): its idle cost, one BLPOP per this long.
LISTEN_IDLE_SECONDS = 30


class _Cluster(RedisCluster):
    """redis-py's asyncio cluster client, made ready before its first command: commands sent
    at once to a new client otherwise pick their node before the client knows the cluster,
    and some run on the seed's connection as the client closes it (``TypeError`` from the
    transport; redis-py 8.1, seen under 80 requests at once)."""

    _ready: asyncio.Lock | None = None

    async def ready(self) -> None:
        if self._initialize:
            if self._ready is None:
                self._ready = asyncio.Lock()
            async with self._ready:
                if self._initialize:
                    await self.initialize()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        await self.ready()
        return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        if not transaction:
            pipe._execution_strategy = _SentOnce(pipe)
        return pipe


class _HiredisPacking:
    """Commands packed by hiredis (C), as redis-py's synchronous client packs them when
    hiredis is installed; its asyncio client packs in Python, several times slower (a
    request sends a few script calls: ``bench/RESULTS.md``, the embeddings section). The
    same bytes either way (``tests/inference/test_lua.py``)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except (TypeError, ValueError):
            pass  # hiredis refuses a bytearray (redis-py takes it): never sent on the hot path
        args = tuple(bytes(a) if isinstance(a, bytearray) else a for a in args)
        try:
            return [hiredis.pack_command(args)]
        except (TypeError, ValueError) as error:  # (a str that is not UTF-8, say)
            raise DataError(str(error)) from error


_packings: dict[type, type] = {}


def _packing(connection_class: type) -> type:
    """``connection_class`` (plain, TLS or a Unix socket's), packing with hiredis."""
    if issubclass(connection_class, _HiredisPacking):
        return connection_class
    found = _packings.get(connection_class)
    if found is None:
        name = f"Packed{connection_class.__name__}"
        found = _packings[connection_class] = type(name, (_HiredisPacking, connection_class), {})
    return found


def _packed(client: Any) -> None:
    """Every connection ``client`` makes from now on packs with hiredis."""
    if isinstance(client, RedisCluster):
        kwargs = client.nodes_manager.connection_kwargs
        kwargs["connection_class"] = _packing(kwargs.get("connection_class", Connection))
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = _packing(node.connection_class)
    else:
        pool = client.connection_pool
        pool.connection_class = _packing(pool.connection_class)


def _relearn(client: Any, error: BaseException) -> None:
    """The next command learns the cluster's nodes and slots again (not a connection
    closed: those busy for other requests finish). A pool out of connections is no news
    about the cluster."""
    if not isinstance(error, MaxConnectionsError):
        client._initialize = True


class _SentOnce(PipelineStrategy):
    """A cluster pipeline sent once. redis-py retries a pipeline one of whose nodes failed,
    and sends again every command whose answer it lacks or whose answer was empty: a script
    that had run on a live node ran again — a request's end met a dead node and RELEASE added
    the request's tokens to its tenant's month four times (tests/inference/test_cluster.py).
    This one raises instead, and the caller's fallback takes over (``settle`` writes the
    usage record to Postgres); the client learns the cluster again on its next command, as
    redis-py's own command path does (connections busy elsewhere finish what they carry).
    A node that refuses the connection makes the whole pipeline raise while the other
    nodes' parts still run: a script that ran there gets no ``then`` (``Batch``). Commands
    redirected (MOVED/ASK) are sent to their new node by redis-py, which retries those."""

    async def execute(
        self, raise_on_error: bool = True, allow_redirections: bool = True
    ) -> list[Any]:
        if not self._command_queue:
            return []
        client = self._pipe.cluster_client
        try:
            if isinstance(client, _Cluster):
                await client.ready()
            results: list[Any] = await self._execute(
                client,
                self._command_queue,
                raise_on_error=raise_on_error,
                allow_redirections=allow_redirections,
            )
        except RedisCluster.ERRORS_ALLOW_RETRY as error:
            _relearn(client, error)
            raise
        else:
            # A node lost while its answers were read: the same, the errors left in place.
            for result in results:
                if isinstance(result, RedisCluster.ERRORS_ALLOW_RETRY):
                    _relearn(client, result)
            return results
        finally:
            await self.reset()  # type: ignore[no-untyped-call]


async def client_ready(client: aioredis.Redis) -> aioredis.Redis:
    """``client``, knowing its cluster's nodes (a subscription picks its node before any
    command would have taught it)."""
    if isinstance(client, _Cluster):
        await client.ready()
    return client


_shared: dict[asyncio.AbstractEventLoop, aioredis.Redis] = {}
_blocking: dict[asyncio.AbstractEventLoop, aioredis.Redis] = {}


def state_use(url: str) -> None:
    """This process's data-plane state at ``url`` from now on (one Redis, or a
    ``redis+cluster://`` URL): every client made from ``STATE_REDIS_URL`` is made again. For
    the tests and benchmarks that move the state between phases."""
    from controlplane.redis import channel, redis_blocking, redis_sync

    settings.STATE_REDIS_URL = url
    for cached in (redis_sync, redis_blocking, channel):
        cached.cache_clear()
    _shared.clear()
    _blocking.clear()


def redis_async() -> aioredis.Redis:
    """The hot path's client: a read that takes more than 5 s means a dead connection."""
    return _for_this_loop(_shared, socket_timeout=5, health_check_interval=30, max_connections=512)


def redis_async_blocking() -> aioredis.Redis:
    """For the admission listeners' long blocking reads: a pool of its own whose socket
    outwaits the longest block. No health-check PING before each read: a dead connection
    shows as the read's own timeout."""
    return _for_this_loop(_blocking, socket_timeout=LISTEN_IDLE_SECONDS + 5)


def _for_this_loop(
    clients: dict[asyncio.AbstractEventLoop, aioredis.Redis], **options: Any
) -> aioredis.Redis:
    loop = asyncio.get_running_loop()
    found = clients.get(loop)
    if found is not None:
        return found
    options.update(
        socket_connect_timeout=2,
        # Which process a connection is (CLIENT LIST): the operator's, and the benchmark's
        # count of what an idle gateway asks Redis.
        client_name=f"inferplane-gateway-{os.getpid()}",
        # A restarted Redis is reconnected to on the next command, not by a restart of ours.
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=3),
    )
    seed = cluster_seed(settings.STATE_REDIS_URL)
    client: aioredis.Redis
    if seed is None:
        client = aioredis.Redis.from_url(
            settings.STATE_REDIS_URL,
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            **options,
        )
    else:
        # A node's failure is the cluster client's to handle: it refreshes the slot map and
        # retries on the slot's new owner (a promoted replica).
        client = _Cluster.from_url(seed, **options)  # type: ignore[assignment]
    _packed(client)
    clients[loop] = client
    return client
