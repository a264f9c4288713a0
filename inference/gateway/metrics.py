"""The gateway's own Prometheus metrics, recorded on the request path (``/metrics`` serves
them with the platform's state read at scrape time: ``controlplane.metrics``).

Names are ``inferplane_*`` in base units (seconds, tokens). Labels come from a fixed
allowlist: ``pool``, ``model`` (the public base model: never an adapter), ``endpoint``,
``status`` (the ledger's), ``priority`` (the class), ``type`` (``errors.ERROR_KINDS``), ``kind``
and ``tenant`` (the
tenant's slug, for the first ``INFERPLANE_METRICS_TENANTS`` tenants this process sees; every
later one is ``other``). Never a key, a request id or an adapter: a label's every value is a
series Prometheus keeps, and a client must not be able to mint them.

The histograms use vLLM's own bucket boundaries (vllm/v1/metrics/buckets.py, 0.32), so a
gateway quantile and the engine's quantile of the same thing compare bucket for bucket.

With several web processes (uvicorn ``--workers N``) every process writes its values to
files in ``PROMETHEUS_MULTIPROC_DIR`` and a scrape of any one of them sums them all
(prometheus_client's multiprocess mode; ``scripts/web.sh`` sets it up). Exemplars (the
request id on a TTFT or latency observation) exist only in one-process mode: prometheus_client
does not keep them in its multiprocess files.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from django.conf import settings
from prometheus_client import Counter, Histogram

if TYPE_CHECKING:
    from contract import UsageRecord
    from inference.gateway.errors import ApiError

# vLLM 0.32's buckets (REQUEST_LATENCY, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY).
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# The admission queue: a wait is bounded by the pool's max_queue_wait_seconds (default 30 s);
# vLLM's request_queue_time uses the request-latency buckets, which start at 0.3 s, and most
# of ours are immediate, so finer ones below it (the same as TTFT's there).
QUEUE_WAIT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, *REQUEST_LATENCY_BUCKETS,
)  # fmt: skip

OTHER = "other"
NONE = "none"  # no tenant (the key was not accepted)

REQUESTS = Counter(
    "inferplane_requests",
    "Completion requests the gateway ran and metered, by the ledger's status "
    "(ok, error, cut_off, content_filter, cache_hit: answered from the tenant's response "
    "cache, docs/cache.md): each is one row of the usage ledger. route and "
    "target: the routed name asked for and the target that served it (a canary; the "
    "target is a model's name or an adapter's version, v<N>), empty when not routed. "
    "priority: the class it ran in (interactive, standard, background; docs/priority.md).",
    ["pool", "model", "endpoint", "status", "tenant", "route", "target", "priority"],
)
ERRORS = Counter(
    "inferplane_request_errors",
    "Requests that did not end ok, by what went wrong (refused before running, or ended "
    "badly after): auth, rate_limited, queue_timeout, overloaded, upstream, adapter_load, "
    "client_disconnect, invalid_request, content_filter, internal.",
    ["endpoint", "type", "tenant"],
)
TOKENS = Counter(
    "inferplane_tokens",
    "Tokens of metered requests, as the engine counted them (kind: prompt, completion, "
    "cached; cached tokens are part of the prompt's).",
    ["pool", "model", "kind", "tenant"],
)
COST = Counter(
    "inferplane_cost_dollars",
    "What metered requests cost at the price book's rates, in US dollars (the ledger's "
    "micro-dollars / 1e6; batch lines are billed by the workers and not counted here).",
    ["pool", "model", "tenant"],
)
TTFT = Histogram(
    "inferplane_time_to_first_token_seconds",
    "From the request's arrival to the engine's first event relayed (queue wait included), "
    "by the priority class it ran in.",
    ["pool", "model", "tenant", "priority"],
    buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
)
ITL = Histogram(
    "inferplane_inter_token_latency_seconds",
    "The gap between two consecutive deliveries of a stream's tokens, as the gateway "
    "received them from the engine.",
    ["pool", "model"],
    buckets=INTER_TOKEN_LATENCY_BUCKETS,
)
E2E = Histogram(
    "inferplane_e2e_request_latency_seconds",
    "From the request's arrival to its end (answered, failed, cut off or filtered).",
    ["pool", "model", "endpoint"],
    buckets=REQUEST_LATENCY_BUCKETS,
)
QUEUE_WAIT = Histogram(
    "inferplane_admission_queue_wait_seconds",
    "How long a request waited for fair admission to a replica (0 when there was room), by "
    "the priority class whose band it waited in.",
    ["pool", "tenant", "priority"],
    buckets=QUEUE_WAIT_BUCKETS,
)
MODERATION_CHECKS = Counter(
    "inferplane_moderation_checks",
    "Moderation checks run (stage: input, output, api), by verdict: pass, flag, log, "
    "block, error (a check that failed or ran out of time).",
    ["stage", "verdict"],
)
MODERATION_CHECK_SECONDS = Histogram(
    "inferplane_moderation_check_seconds",
    "How long one moderation check took (rules, classifier and guard model together).",
    ["stage"],
    buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
)
MODERATION_CUTS = Counter(
    "inferplane_moderation_cuts",
    "Answers the output guard stopped with finish_reason content_filter, by output mode.",
    ["mode"],
)


# Every series of a fixed label set exists from the start (at 0), so a rate over it is 0
# rather than absent until the first event: dashboards and alerts see "none yet".
for _stage in ("input", "output", "api"):
    for _verdict in ("pass", "flag", "log", "block", "error"):
        MODERATION_CHECKS.labels(_stage, _verdict)
    MODERATION_CHECK_SECONDS.labels(_stage)
for _mode in ("hold", "async"):
    MODERATION_CUTS.labels(_mode)


class TenantLabels:
    """The tenant label: the slug of the first ``cap`` tenants this process sees, ``other``
    for every later one, so 1,000 tenants cost at most ``cap`` series per metric per process."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.seen: set[str] = set()

    def __call__(self, slug: str) -> str:
        if slug in self.seen:
            return slug
        if len(self.seen) < self.cap:
            self.seen.add(slug)
            return slug
        return OTHER


_tenants: TenantLabels | None = None


def tenant_label(slug: str) -> str:
    global _tenants
    if _tenants is None:
        _tenants = TenantLabels(settings.INFERPLANE_METRICS_TENANTS)
    return _tenants(slug)


def request_settled(
    record: UsageRecord,
    *,
    tenant_slug: str,
    seconds: float,
    error_kind: str = "",
    cost_micros: int = 0,
) -> None:
    """One metered request, from its settled record: its status, tokens and cost, its
    latencies (``seconds``: its whole time, unrounded). ``error_kind``: what a failure is
    counted as when the status does not tell (``errors.ERROR_KINDS``)."""
    pool, model, endpoint = record.pool, record.model, record.endpoint
    tenant = tenant_label(tenant_slug)
    route, target = "", ""
    if record.route:
        # An adapter's route is named by its tenant's address: not a label (tenants could
        # mint them); its targets are versions of one adapter.
        route = "adapter" if record.adapter else record.route
        target = f"v{record.adapter.rpartition(':')[2]}" if record.adapter else model
    REQUESTS.labels(
        pool, model, endpoint, record.status, tenant, route, target, record.priority
    ).inc()
    TOKENS.labels(pool, model, "prompt", tenant).inc(record.prompt_tokens)
    TOKENS.labels(pool, model, "completion", tenant).inc(record.completion_tokens)
    if record.cached_tokens:
        TOKENS.labels(pool, model, "cached", tenant).inc(record.cached_tokens)
    if cost_micros:
        COST.labels(pool, model, tenant).inc(cost_micros / 1_000_000)
    exemplar = {"request_id": record.request_id}
    if record.status == "cache_hit":  # the pool did nothing: its latencies are not this
        return
    if record.ttft_ms is not None:
        TTFT.labels(pool, model, tenant, record.priority).observe(record.ttft_ms / 1000, exemplar)
    E2E.labels(pool, model, endpoint).observe(seconds, exemplar)
    if record.status != "ok":
        ERRORS.labels(endpoint, error_kind or _ENDED[record.status], tenant).inc()


# What a metered request that did not end ok is counted as, unless the call says
# (``Call.error_kind``: an engine that refused the request as invalid, say).
_ENDED = {"error": "upstream", "cut_off": "client_disconnect", "content_filter": "content_filter"}


def request_refused(error: ApiError, *, endpoint: str, tenant_slug: str | None) -> None:
    """A request answered with an error before it ran (nothing metered)."""
    tenant = tenant_label(tenant_slug) if tenant_slug else NONE
    ERRORS.labels(endpoint, error.kind, tenant).inc()


def queue_waited(*, pool: str, tenant_slug: str, priority: str, seconds: float) -> None:
    QUEUE_WAIT.labels(pool, tenant_label(tenant_slug), priority).observe(seconds)


class TokenGaps:
    """One stream's inter-token gaps, counted by bucket in the stream's own list and added to
    ``inferplane_inter_token_latency_seconds`` once, when the stream ends: an observation per
    engine read costs about 3 us in multiprocess mode (a locked write to a shared file, twice),
    a few percent of the gateway's CPU per token; this costs a list increment."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(INTER_TOKEN_LATENCY_BUCKETS) + 1)  # the last one: +Inf
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect_left(INTER_TOKEN_LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def flush(self, *, pool: str, model: str) -> None:
        """Into the stream's series, as many ``observe()`` calls would have (prometheus_client
        keeps a histogram child's buckets non-cumulative, one value each, and its sum)."""
        if not any(self.counts):
            return
        child = ITL.labels(pool, model)
        for bucket, n in zip(child._buckets, self.counts, strict=True):
            if n:
                bucket.inc(n)
        child._sum.inc(self.total)
        self.counts = [0] * len(self.counts)
        self.total = 0.0


def moderation_request(*, tenant_slug: str, model: str, status: str) -> None:
    """One ``/v1/moderations`` request: metered (a ledger row) like a completion."""
    tenant = tenant_label(tenant_slug)
    REQUESTS.labels("", model, "moderations", status, tenant, "", "", "").inc()
    if status != "ok":
        ERRORS.labels("moderations", "upstream", tenant).inc()


def moderation_checked(
    stage: str, *, action: str | None, failed: bool, seconds: float | None = None
) -> None:
    """One moderation check's verdict (and, when it was timed, how long it took)."""
    verdict = "error" if failed else (action or "pass")
    MODERATION_CHECKS.labels(stage, verdict).inc()
    if seconds is not None:
        MODERATION_CHECK_SECONDS.labels(stage).observe(seconds)


# --- the operator page's sparklines -------------------------------------------------------------
# The same observations as TTFT and the queue wait above, also counted per pool in Redis in
# 10-second windows (by the same buckets), so the operator page draws the last minutes for
# every web process together without a Prometheus.
SPARK_WINDOW_SECONDS = 10
SPARK_KEEP_SECONDS = 1200


def spark_key(pool: str, window: int) -> str:
    return f"ip:ops:spark:{pool}:{window}"


def _bucket(buckets: tuple[float, ...], value: float) -> int:
    """The index of the first bucket holding ``value`` (len(buckets): above them all)."""
    for i, bound in enumerate(buckets):
        if value <= bound:
            return i
    return len(buckets)


def spark_into(pipe: Any, record: UsageRecord, *, queue_wait: float, now: float) -> None:
    """Count a settled request's TTFT and queue wait in its pool's current window (on the
    pipeline that carries the request's other end-of-life work: no extra round trip)."""
    if record.ttft_ms is None:
        return
    key = spark_key(record.pool, int(now // SPARK_WINDOW_SECONDS))
    pipe.hincrby(key, "n", 1)
    pipe.hincrby(key, f"t{_bucket(TIME_TO_FIRST_TOKEN_BUCKETS, record.ttft_ms / 1000)}", 1)
    pipe.hincrby(key, f"w{_bucket(QUEUE_WAIT_BUCKETS, queue_wait)}", 1)
    pipe.expire(key, SPARK_KEEP_SECONDS)


def spark_p95(counts: dict[str, int], prefix: str, buckets: tuple[float, ...]) -> float | None:
    """The 95th percentile of one window, as the upper bound of the bucket that holds it
    (the last bound for values above every bucket); None for an empty window."""
    total = counts.get("n", 0)
    if not total:
        return None
    seen = 0
    for i in range(len(buckets) + 1):
        seen += counts.get(f"{prefix}{i}", 0)
        if seen >= 0.95 * total:
            return buckets[min(i, len(buckets) - 1)]
    return buckets[-1]
