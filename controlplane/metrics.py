"""``GET /metrics``: the gateway's Prometheus exposition.

Two kinds of series:
- what the request path records in this process (``inference.api.metrics``): requests,
  errors, tokens, latencies, moderation. With several web processes they are summed over
  all of them (prometheus_client's multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``), so any
  process's scrape is the whole server's;
- the platform's shared state, read when scraped: admission queue depth and sequences in
  flight per pool (Redis, where admission keeps them for every process), replicas by state,
  batch lines by state and the nearest batch deadline (Postgres). Every web process reports
  the same value for these: aggregate them with ``max``, not ``sum``.

A source that cannot be read leaves its series out and says so in
``inferplane_state_up{source}`` (0), rather than failing the scrape.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Iterable, Iterator

from asgiref.sync import sync_to_async
from channels.generic.http import AsyncHttpConsumer
from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.db.models import Count, Min
from prometheus_client import REGISTRY, CollectorRegistry, multiprocess
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from batches.models import Batch, Line
from batches.runner import BATCH_LINES_KEY  # the workers count lines there (not scraped)
from controlplane.redis import redis_sync
from inference.api.admission import queue_state
from inference.catalog import pool_prefix
from inference.models import Pool, Replica

log = logging.getLogger(__name__)


_ACTIVE_BATCHES = (Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING, Batch.Status.FINALIZING)


class PlatformCollector(Collector):
    """The shared state, read at scrape time (a few Redis round trips and three queries)."""

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "inferplane_state_up",
            "Whether the platform's state could be read for this scrape (source: redis, "
            "database); 0 leaves that source's series out.",
            labels=["source"],
        )
        pools: list[str] = []
        try:
            pools = list(Pool.objects.order_by("name").values_list("name", flat=True))
            yield from self._replicas()
            yield from self._batches()
            up.add_metric(["database"], 1)
        except DatabaseError:
            log.warning("metrics: the database could not be read", exc_info=True)
            up.add_metric(["database"], 0)
        try:
            yield from self._admission(pools)
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
        client = redis_sync()
        for pool in pools:
            state = queue_state(pool)
            room = client.hgetall(pool_prefix(pool) + "replicas")
            depth.add_metric([pool], state.queued)
            inflight.add_metric([pool], sum(state.in_flight.values()))
            capacity.add_metric([pool], sum(int(n) for name, n in room.items() if name != b"none"))
            waiting.add_metric([pool], len(state.waiting))
        return (depth, inflight, capacity, waiting)

    def _replicas(self) -> Iterable[Metric]:
        replicas = GaugeMetricFamily(
            "inferplane_pool_replicas",
            "The pool's replicas by state (ready, draining, down); kind: dedicated (online) "
            "or spot (batch, may be scaled to zero).",
            labels=["pool", "kind", "state"],
        )
        counted = {
            (row["pool__name"], row["state"]): row["n"]
            for row in Replica.objects.values("pool__name", "state").annotate(n=Count("id"))
        }
        for pool, kind in Pool.objects.order_by("name").values_list("name", "kind"):
            for state in Replica.State.values:
                replicas.add_metric([pool, kind, state], counted.get((pool, state), 0))
        return (replicas,)

    def _batches(self) -> Iterable[Metric]:
        lines = GaugeMetricFamily(
            "inferplane_batch_lines",
            "Lines of the batches under way (in progress, finalizing or cancelling) by state.",
            labels=["state"],
        )
        counted = dict(
            Line.objects.filter(batch__status__in=_ACTIVE_BATCHES)
            .values_list("state")
            .annotate(n=Count("id"))
            .values_list("state", "n")
        )
        for state in Line.State.values:
            lines.add_metric([state], counted.get(state, 0))
        batches = GaugeMetricFamily(
            "inferplane_batches", "Batches by status (the ones not finished).", labels=["status"]
        )
        by_status = dict(
            Batch.objects.exclude(status__in=Batch.FINISHED)
            .values_list("status")
            .annotate(n=Count("id"))
            .values_list("status", "n")
        )
        for status in Batch.Status.values:
            if status not in Batch.FINISHED:
                batches.add_metric([status], by_status.get(status, 0))
        deadline = GaugeMetricFamily(
            "inferplane_batch_deadline_seconds",
            "Seconds until the nearest completion window of a batch in progress ends "
            "(absent when none is in progress).",
        )
        nearest = Batch.objects.filter(status=Batch.Status.IN_PROGRESS).aggregate(
            at=Min("expires_at")
        )["at"]
        if nearest is not None:
            deadline.add_metric([], nearest.timestamp() - time.time())
        metrics: list[Metric] = [lines, batches, deadline]
        try:
            stored = redis_sync().hgetall(BATCH_LINES_KEY)
        except RedisError:
            return metrics
        processed = CounterMetricFamily(
            "inferplane_batch_lines_processed",
            "Batch lines the workers answered, by outcome (done: 200; failed: an error line).",
            labels=["outcome"],
        )
        for outcome in ("done", "failed"):
            processed.add_metric([outcome], int(stored.get(outcome.encode(), 0)))
        metrics.append(processed)
        return metrics


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
    close_old_connections()
    try:
        encoder, content_type = choose_encoder(accept)
        return encoder(_registry()), content_type
    finally:
        close_old_connections()


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
        if token:
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
