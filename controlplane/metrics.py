"""``GET /metrics``: the gateway's Prometheus exposition, for a bearer token only
(``INFERPLANE_METRICS_TOKEN``; without one configured the endpoint refuses everyone: it
names tenants and their spend).

Two kinds of series:
- what the request path records in this process (``inference.gateway.metrics``): requests,
  errors, tokens, latencies, moderation. With several web processes they are summed over
  all of them (prometheus_client's multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``), so any
  process's scrape is the whole server's;
- the platform's shared state, read from Redis when scraped: admission queue depth and
  sequences in flight per pool (where admission keeps them for every process), replicas by
  state (the catalog the probes publish), batch lines by state and the nearest batch deadline
  (counted by the sweeper, ``batches.gauges``). A scrape reads no database. Every web
  process reports the same value for these: aggregate them with ``max``, not ``sum``.

A source that cannot be read leaves its series out and says so in
``inferplane_state_up{source}`` (0), rather than failing the scrape.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator

import msgspec
from asgiref.sync import sync_to_async
from channels.generic.http import AsyncHttpConsumer
from django.conf import settings
from prometheus_client import REGISTRY, CollectorRegistry, multiprocess
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from batches.gauges import BatchGauges, batch_gauges_read
from batches.lines import BATCH_LINES_KEY  # the workers count lines there (not scraped)
from contract import Catalog
from controlplane.redis import redis_sync
from fleet.models import Replica
from inference.catalog import catalog_published, pool_prefix
from inference.gateway.admission import queue_state

log = logging.getLogger(__name__)


class PlatformCollector(Collector):
    """The shared state, read at scrape time from Redis alone: the admission state (a few
    round trips per pool), the catalog the probes publish (replicas by state) and the batch
    counts the sweeper stores (``batches.gauges``). A scrape costs the database nothing."""

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "inferplane_state_up",
            "Whether the platform's state could be read for this scrape (source: redis, the "
            "admission state; catalog, replicas by state, published by the probes; batches, "
            "counted by the sweeper); 0 leaves that source's series out.",
            labels=["source"],
        )
        catalog: Catalog | None = None
        try:
            catalog = catalog_published()
        except (RedisError, msgspec.DecodeError):
            log.warning("metrics: the catalog could not be read", exc_info=True)
        if catalog is not None:
            yield from self._replicas(catalog)
        up.add_metric(["catalog"], int(catalog is not None))
        try:
            gauges = batch_gauges_read()
        except RedisError:
            gauges = None
        if gauges is not None:
            yield from self._batches(gauges)
        up.add_metric(["batches"], int(gauges is not None))
        yield from self._processed()
        try:
            yield from self._admission(sorted(catalog.pools) if catalog else [])
            up.add_metric(["redis"], 1)
        except RedisError:
            log.warning("metrics: Redis could not be read", exc_info=True)
            up.add_metric(["redis"], 0)
        yield up

    def _admission(self, pools: list[str]) -> Iterable[Metric]:
        depth = GaugeMetricFamily(
            "inferplane_admission_queue_depth",
            "Requests waiting for fair admission in the pool, all web processes together.",
            labels=["pool"],
        )
        inflight = GaugeMetricFamily(
            "inferplane_admission_in_flight",
            "Sequences admitted and running on the pool's replicas (a request of n "
            "sequences counts n).",
            labels=["pool"],
        )
        capacity = GaugeMetricFamily(
            "inferplane_admission_capacity",
            "Sequences the pool's replicas in rotation can run at once (their max_inflight).",
            labels=["pool"],
        )
        waiting = GaugeMetricFamily(
            "inferplane_admission_tenants_waiting",
            "Tenants with a request waiting for admission in the pool.",
            labels=["pool"],
        )
        lent = GaugeMetricFamily(
            "inferplane_admission_lent",
            "Sequences batch lines run on room an online pool lends (part of in_flight).",
            labels=["pool"],
        )
        reclaimed = CounterMetricFamily(
            "inferplane_admission_lent_reclaimed",
            "Lent requests whose room an online request took back (the line was aborted and "
            "runs again).",
            labels=["pool"],
        )
        client = redis_sync()
        for pool in pools:
            state = queue_state(pool)
            lent.add_metric([pool], state.lent)
            reclaimed.add_metric([pool], state.reclaimed)
            room = client.hgetall(pool_prefix(pool) + "replicas")
            depth.add_metric([pool], state.queued)
            inflight.add_metric([pool], sum(state.in_flight.values()))
            capacity.add_metric([pool], sum(int(n) for name, n in room.items() if name != b"none"))
            waiting.add_metric([pool], len(state.waiting))
        return (depth, inflight, capacity, waiting, lent, reclaimed)

    def _replicas(self, catalog: Catalog) -> Iterable[Metric]:
        replicas = GaugeMetricFamily(
            "inferplane_pool_replicas",
            "The pool's replicas by state (ready, draining, down); kind: dedicated (online) "
            "or spot (batch, may be scaled to zero).",
            labels=["pool", "kind", "state"],
        )
        for name, pool in sorted(catalog.pools.items()):
            states = Counter(replica.state for replica in pool.replicas.values())
            for state in Replica.State.values:
                replicas.add_metric([name, pool.kind, state], states.get(state, 0))
        return (replicas,)

    def _batches(self, gauges: BatchGauges) -> Iterable[Metric]:
        lines = GaugeMetricFamily(
            "inferplane_batch_lines",
            "Lines of the batches under way (in progress, finalizing or cancelling) by state.",
            labels=["state"],
        )
        for state, n in gauges.lines.items():
            lines.add_metric([state], n)
        batches = GaugeMetricFamily(
            "inferplane_batches", "Batches by status (the ones not finished).", labels=["status"]
        )
        for status, n in gauges.batches.items():
            batches.add_metric([status], n)
        deadline = GaugeMetricFamily(
            "inferplane_batch_deadline_seconds",
            "Seconds until the nearest completion window of a batch in progress ends "
            "(absent when none is in progress).",
        )
        if gauges.deadline is not None:
            deadline.add_metric([], gauges.deadline - time.time())
        return (lines, batches, deadline)

    def _processed(self) -> Iterable[Metric]:
        try:
            stored = redis_sync().hgetall(BATCH_LINES_KEY)
        except RedisError:
            return ()
        processed = CounterMetricFamily(
            "inferplane_batch_lines_processed",
            "Batch lines the workers answered, by outcome (done: 200; failed: an error line).",
            labels=["outcome"],
        )
        for outcome in ("done", "failed"):
            processed.add_metric([outcome], int(stored.get(outcome.encode(), 0)))
        return (processed,)


_platform = PlatformCollector()


class _Chain(Collector):
    def __init__(self, *collectors: Collector) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for collector in self.collectors:
            yield from collector.collect()


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Every web process's files, summed (counters of processes that ended included).
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        registry.register(_platform)
    else:
        registry.register(_Chain(REGISTRY, _platform))
    return registry


def _render(accept: str) -> tuple[bytes, str]:
    encoder, content_type = choose_encoder(accept)
    return encoder(_registry()), content_type


class MetricsConsumer(AsyncHttpConsumer):
    """Routed before Django (``controlplane.asgi``): Prometheus scrapes a pod by its address,
    over plain HTTP, which Django's host check and HTTPS redirect would refuse."""

    channel_layer_alias = "__none__"

    async def handle(self, body: bytes) -> None:
        headers = dict(self.scope["headers"])
        if self.scope["method"] not in ("GET", "HEAD"):
            await self.send_response(
                405, b"Method not allowed: GET /metrics.\n", headers=[*_TEXT, (b"allow", b"GET")]
            )
            return
        token = settings.INFERPLANE_METRICS_TOKEN
        if not token:
            # The exposition names tenants and their spend: never anonymous.
            await self.send_response(
                403,
                b"Forbidden: /metrics is off until INFERPLANE_METRICS_TOKEN is set on the web "
                b"service (make run generates one in var/metrics-token); Prometheus then sends "
                b"it as Authorization: Bearer <token>.\n",
                headers=_TEXT,
            )
            return
        presented = headers.get(b"authorization", b"").removeprefix(b"Bearer ").strip()
        if not hmac.compare_digest(presented, token.encode()):
            await self.send_response(
                401,
                b"Unauthorized: send Authorization: Bearer <INFERPLANE_METRICS_TOKEN>.\n",
                headers=[*_TEXT, (b"www-authenticate", b"Bearer")],
            )
            return
        accept = headers.get(b"accept", b"").decode("latin-1")
        output, content_type = await sync_to_async(_render)(accept)
        await self.send_response(200, output, headers=[(b"content-type", content_type.encode())])


_TEXT = [(b"content-type", b"text/plain; charset=utf-8")]
