"""Writes for models, pools, replicas and routes."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import dns.exception
import dns.resolver
import httpx
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from redis.exceptions import RedisError

from adapters.models import Adapter
from adapters.services import adapter_files_remove
from controlplane.redis import redis_sync
from fleet.engine_metrics import engine_metrics_parse
from fleet.models import (
    Model,
    ModelRoute,
    Pool,
    Replica,
    dns_name_validator,
    engine_url_validator,
    name_validator,
)
from inference.catalog import adapters_held_key, catalog_publish, pool_prefix
from inference.engine_auth import engine_auth_headers
from inference.gateway import cache
from inference.gateway.admission import adapter_in_use
from inference.gateway.lora import RECONCILE
from inference.selectors import replica_in_flight, replicas_in_flight
from tenants.models import Tenant, User
from tenants.services import audit_record

log = logging.getLogger(__name__)


@transaction.atomic
def model_ensure(
    *,
    name: str,
    served_name: str,
    context_length: int,
    supports_lora: bool = False,
    architecture: dict[str, Any] | None = None,
    task: str = Model.Task.GENERATE,
) -> Model:
    name_validator(name)  # no '/': that addresses tenants' adapters
    defaults: dict[str, Any] = {
        "served_name": served_name,
        "context_length": context_length,
        "supports_lora": supports_lora,
        "task": task,
    }
    if architecture is not None:
        defaults["architecture"] = architecture
    model, _ = Model.objects.update_or_create(name=name, defaults=defaults)
    transaction.on_commit(catalog_publish)
    return model


@transaction.atomic
def pool_ensure(
    *,
    name: str,
    kind: str,
    model: Model,
    replica_urls: list[str],
    discovery: str | None = None,
) -> Pool:
    """Create or update a pool and make its replicas exactly ``replica_urls`` (with DNS
    discovery: its hand-registered ones; those found by discovery are discovery's).
    ``discovery``: ``static`` or ``http(s)://SERVICE-NAME:PORT`` (see ``discovery_parse``)."""
    urls = [url.rstrip("/") for url in replica_urls]
    pool, _ = Pool.objects.update_or_create(name=name, defaults={"kind": kind, "model": model})
    pool = _pool_locked(pool)
    if discovery is not None:
        _discovery_apply(pool, discovery)
        pool.full_clean()
        pool.save()
    managed = pool.replicas.all()
    if pool.discovery == Pool.Discovery.DNS:
        managed = managed.filter(discovered=False)
    for replica in managed.exclude(url__in=urls):
        _replica_delete(replica)
    for url in urls:
        if not pool.replicas.filter(url=url).exists():
            _replica_create(pool=pool, url=url)
    transaction.on_commit(catalog_publish)
    return pool


@transaction.atomic
def pool_configure(
    *,
    pool: Pool,
    max_inflight: int | None = None,
    policy: str | None = None,
    max_queue_wait_seconds: int | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    discovery: str | None = None,
    drain_grace_seconds: int | None = None,
    lend_percent: int | None = None,
    actor: User | None = None,
) -> Pool:
    before = {field: getattr(pool, field) for field in POOL_SETTINGS}
    for field, value in (
        ("lend_percent", lend_percent),
        ("max_inflight", max_inflight),
        ("policy", policy),
        ("max_queue_wait_seconds", max_queue_wait_seconds),
        ("max_loras", max_loras),
        ("max_lora_rank", max_lora_rank),
        ("drain_grace_seconds", drain_grace_seconds),
    ):
        if value is not None:
            setattr(pool, field, value)
    if discovery is not None:
        _discovery_apply(pool, discovery)
    pool.full_clean()
    pool.save()
    changed = {
        field: [before[field], getattr(pool, field)]
        for field in POOL_SETTINGS
        if before[field] != getattr(pool, field)
    }
    if changed:
        _platform_audit(actor, "pool.configure", pool, changed)
    transaction.on_commit(catalog_publish)
    return pool


# What pool_configure changes, each recorded as [before, after] in the audit log.
POOL_SETTINGS = (
    "max_inflight",
    "policy",
    "max_queue_wait_seconds",
    "max_loras",
    "max_lora_rank",
    "discovery_url",
    "drain_grace_seconds",
    "lend_percent",
)


def _platform_audit(
    actor: User | None, action: str, target: object, details: dict[str, Any]
) -> None:
    """An operator's change to the fleet, in the platform's audit log (no tenant): who
    drained a replica, moved a route's weights or resized a pool, and when."""
    audit_record(actor=actor, tenant=None, action=action, target=target, details=details)


@transaction.atomic
def replica_set_state(*, replica: Replica, state: str) -> Replica:
    """An operator's decision (drain for an upgrade, bring back): probes keep draining as is."""
    replica.state = state
    replica.full_clean()
    replica.save(update_fields=["state"])
    transaction.on_commit(catalog_publish)
    return replica


# --- Registering replicas: by hand, or from DNS ------------------------------------------------


def discovery_parse(value: str) -> dict[str, Any]:
    """``static``, or ``http(s)://SERVICE-NAME:PORT``: every A and AAAA address of that name
    is a replica served with that scheme at that port. Returns the pool fields to set."""
    if value == Pool.Discovery.STATIC:
        return {"discovery": Pool.Discovery.STATIC}
    message = (
        "use 'static' or http(s)://SERVICE-NAME:PORT (e.g. "
        f"http://vllm-online.inferplane.svc.cluster.local:8000), not {value!r}"
    )
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ValidationError({"discovery": message}) from None
    if (
        parts.scheme not in Pool.Scheme.values
        or not parts.hostname
        or parts.path not in {"", "/"}
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValidationError({"discovery": message})
    try:
        dns_name_validator(parts.hostname)
    except ValidationError:
        raise ValidationError({"discovery": message}) from None
    return {
        "discovery": Pool.Discovery.DNS,
        "dns_scheme": parts.scheme,
        "dns_name": parts.hostname,
        "dns_port": port or (443 if parts.scheme == "https" else 80),
    }


def _discovery_apply(pool: Pool, value: str) -> None:
    fields = discovery_parse(value)
    for name, value_ in fields.items():
        setattr(pool, name, value_)
    if pool.discovery == Pool.Discovery.STATIC:
        pool.discovery_error = ""


def _pool_locked(pool: Pool) -> Pool:
    """The pool's row, locked to the end of the transaction: replica names and discovery
    rounds of one pool happen one at a time."""
    return Pool.objects.select_for_update().select_related("model").get(pk=pool.pk)


def _replica_name_next(pool: Pool) -> str:
    """``<pool>-<n>``, n one more than the last given (``pool`` locked by the caller)."""
    while True:
        pool.replica_seq += 1
        name = f"{pool.name[:52]}-{pool.replica_seq}"
        if not pool.replicas.filter(name=name).exists():  # an operator may have taken it
            break
    pool.save(update_fields=["replica_seq"])
    return name


@transaction.atomic
def replica_name_assign(*, replica: Replica) -> Replica:
    """Name a replica that has none (the admin's forms: saved by the caller)."""
    replica.name = _replica_name_next(_pool_locked(replica.pool))
    return replica


def _replica_create(*, pool: Pool, url: str, name: str = "", discovered: bool = False) -> Replica:
    """A new replica (``pool`` locked by the caller), named ``<pool>-<n>`` unless given a
    name. Numbers are never reused: the ledger names replicas, old names stay meaningful."""
    replica = Replica(
        pool=pool, url=url, name=name or _replica_name_next(pool), discovered=discovered
    )
    replica.full_clean()
    replica.save()
    return replica


def _replica_delete(replica: Replica) -> None:
    """Delete the row; after the commit, forget what Redis keeps about the replica."""
    pool, rid = replica.pool.name, str(replica.pk)
    replica.delete()

    def forget() -> None:
        try:
            client = redis_sync()
            client.hdel(pool_prefix(pool) + "rload", rid)
            client.delete(adapters_held_key(pool, rid))
        except RedisError:
            log.warning("could not clear the admission state of removed replica %s", rid)

    transaction.on_commit(forget)


@transaction.atomic
def replica_add(*, pool: Pool, url: str, name: str = "", actor: User | None = None) -> Replica:
    """Register an engine by hand (in a static pool, or beside the discovered ones of a DNS
    pool: those are left alone by discovery). It is ``down`` until its first probe."""
    pool = _pool_locked(pool)
    url = url.strip().rstrip("/")
    try:
        engine_url_validator(url)
    except ValidationError as exc:
        raise ValidationError({"url": exc.messages}) from None
    if pool.replicas.filter(url=url).exists():
        raise ValidationError({"url": f"{url} is already a replica of pool {pool.name}"})
    if name and pool.replicas.filter(name=name).exists():
        raise ValidationError({"name": f"pool {pool.name} already has a replica named {name}"})
    replica = _replica_create(pool=pool, url=url, name=name)
    _platform_audit(actor, "replica.add", replica, {"pool": pool.name, "url": url})
    transaction.on_commit(catalog_publish)
    log.info("replica %s (%s) added to pool %s", replica.name, url, pool.name)
    return replica


def replica_drain(*, replica: Replica, actor: User | None = None) -> Replica:
    """No new requests go to it; the ones running finish. Probes leave it draining."""
    with transaction.atomic():
        replica = replica_set_state(replica=replica, state=Replica.State.DRAINING)
        _platform_audit(actor, "replica.drain", replica, {"pool": replica.pool.name})
    return replica


def replica_undrain(
    *, replica: Replica, timeout: float | None = None, actor: User | None = None
) -> Replica:
    """Back into rotation, once it answers: it is probed now and is ``ready`` or ``down``."""
    if replica.vanished_at is not None:
        raise ValidationError(
            {"state": "its address left the pool's DNS name: it is leaving the pool"}
        )
    replica_set_state(replica=replica, state=Replica.State.DOWN)
    replica = replica_probe(replica=replica, timeout=timeout)
    _platform_audit(
        actor, "replica.ready", replica, {"pool": replica.pool.name, "state": replica.state}
    )
    transaction.on_commit(catalog_publish)
    return replica


@transaction.atomic
def replica_remove(*, replica: Replica, force: bool = False, actor: User | None = None) -> int:
    """Remove a replica. Refused while requests run on it (drain it first and wait), unless
    ``force``: those requests then finish on the engine, or fail over if it goes away.
    Returns the requests that were in flight on it."""
    try:
        in_flight = replica_in_flight(replica=replica)
    except RedisError:
        if not force:
            raise ValidationError(
                {
                    "replica": "cannot tell whether requests run on it (Redis is unreachable): "
                    "force to remove it anyway"
                }
            ) from None
        in_flight = 0
    if in_flight and not force:
        raise ValidationError(
            {
                "replica": f"{in_flight} request(s) in flight on {replica.name}: drain it "
                "first and wait, or force"
            }
        )
    name = replica.name
    _platform_audit(
        actor,
        "replica.remove",
        replica,
        {"pool": replica.pool.name, "url": replica.url, "in_flight": in_flight, "force": force},
    )
    _replica_delete(replica)
    transaction.on_commit(catalog_publish)
    log.info("replica %s removed (%d in flight)", name, in_flight)
    return in_flight


@dataclass
class DiscoveryRound:
    """What one DNS resolution of a pool changed (or why it changed nothing)."""

    addresses: list[str] = dataclasses.field(default_factory=list)
    added: list[str] = dataclasses.field(default_factory=list)
    returned: list[str] = dataclasses.field(default_factory=list)
    drained: list[str] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    error: str = ""


class DnsFailure(Exception):
    pass


def _resolver() -> dns.resolver.Resolver:
    """The system's resolver (resolv.conf), or ``INFERPLANE_DNS_NAMESERVER``."""
    server = settings.INFERPLANE_DNS_NAMESERVER
    if not server:
        resolver = dns.resolver.Resolver()
    else:
        host, port = server, 53
        match = re.fullmatch(r"\[(?P<v6>[^]]+)\](:(?P<p6>\d+))?|(?P<h>[^:]+)(:(?P<p>\d+))?", server)
        if match:
            host = match["v6"] or match["h"]
            port = int(match["p6"] or match["p"] or 53)
        try:
            ipaddress.ip_address(host)
        except ValueError:  # a name: the server's address from the system's resolver
            host = str(socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0][4][0])
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = port
    resolver.lifetime = float(settings.INFERPLANE_PROBE_TIMEOUT_SECONDS)
    return resolver


def dns_addresses(*, name: str) -> set[str]:
    """Every A and AAAA address of ``name`` (a full name; no search domains). A name that
    does not exist or has no address is an answer: no replicas (a Service scaled to zero).
    A failure to get an answer (timeout, SERVFAIL, refused) raises ``DnsFailure``."""
    addresses: set[str] = set()
    try:
        resolver = _resolver()  # a nameserver that is a name, or no resolv.conf, can fail here
        for rdtype in ("A", "AAAA"):
            try:
                answer = resolver.resolve(name, rdtype, search=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            addresses.update(rdata.to_text() for rdata in answer)
    except (dns.exception.DNSException, OSError) as exc:
        raise DnsFailure(f"{type(exc).__name__}: {exc}"[:500]) from exc
    return addresses


def _address_url(pool: Pool, address: str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{pool.dns_scheme}://{host}:{pool.dns_port}"


@transaction.atomic
def pool_discovery_sync(*, pool: Pool) -> DiscoveryRound:
    """Make a DNS pool's discovered replicas its name's addresses: a new address becomes a
    replica (``down`` until probed); one that vanished is set ``draining`` (the catalog takes
    it out of rotation), then removed in a later round once nothing runs on it (the
    admission state's ``rload``) or ``drain_grace_seconds`` after it vanished. A DNS failure
    changes no replica: the last known set stays, and the error is kept on the pool."""
    result = DiscoveryRound()
    pool = _pool_locked(pool)
    if pool.discovery != Pool.Discovery.DNS:
        return result
    try:
        addresses = dns_addresses(name=pool.dns_name)
    except DnsFailure as exc:
        result.error = str(exc)
        log.warning(
            "pool %s: resolving %s failed, replicas kept as they are: %s",
            pool.name,
            pool.dns_name,
            exc,
        )
        if pool.discovery_error != result.error:
            pool.discovery_error = result.error
            pool.save(update_fields=["discovery_error"])
        return result
    if pool.discovery_error:
        pool.discovery_error = ""
        pool.save(update_fields=["discovery_error"])
    result.addresses = sorted(addresses)
    wanted = {_address_url(pool, a) for a in addresses}
    replicas = list(pool.replicas.all())
    known = {r.url for r in replicas}
    now = timezone.now()
    for url in sorted(wanted - known):
        result.added.append(_replica_create(pool=pool, url=url, discovered=True).name)
    leaving = [r for r in replicas if r.discovered and r.url not in wanted]
    in_flight = replicas_in_flight(pool=pool, replicas=[r for r in leaving if r.vanished_at])
    for replica in replicas:
        if not replica.discovered:
            continue  # registered by hand: not discovery's to change
        if replica.url in wanted:
            if replica.vanished_at is not None:
                # The address is back: a new pod has it (or DNS had a gap). Probed as new.
                replica.vanished_at = None
                replica.state = Replica.State.DOWN
                replica.save(update_fields=["vanished_at", "state"])
                result.returned.append(replica.name)
        elif replica.vanished_at is None:
            replica.vanished_at = now
            replica.state = Replica.State.DRAINING
            replica.save(update_fields=["vanished_at", "state"])
            result.drained.append(replica.name)
        else:
            busy = in_flight.get(replica.pk)  # None: Redis could not say
            overdue = (now - replica.vanished_at).total_seconds() >= pool.drain_grace_seconds
            if busy == 0 or overdue:
                if busy:
                    log.warning(
                        "replica %s removed with %d request(s) still counted in flight "
                        "(%ds after its address vanished)",
                        replica.name,
                        busy,
                        pool.drain_grace_seconds,
                    )
                _replica_delete(replica)
                result.removed.append(replica.name)
    if result.added or result.returned or result.drained or result.removed:
        log.info(
            "pool %s discovery (%s): added %s, back %s, draining %s, removed %s",
            pool.name,
            pool.dns_name,
            result.added,
            result.returned,
            result.drained,
            result.removed,
        )
        transaction.on_commit(catalog_publish)
    return result


def replica_probe(
    *,
    replica: Replica,
    timeout: float | None = None,
    round_: ProbeRound | None = None,
) -> Replica:
    """Ask the engine whether it is healthy and serves the pool's model; record the answer.

    A draining replica stays draining (an operator put it there); others become ready or down.
    ``round_``: the probe round it is part of (what the round read of Redis once for all).
    """
    timeout = timeout or settings.INFERPLANE_PROBE_TIMEOUT_SECONDS
    alone = round_ is None  # a round of its own, ended here
    round_ = round_ or ProbeRound.begin()
    served = replica.pool.model.served_name
    error = ""
    loaded: set[str] | None = None
    started_ms = round_.started_ms
    try:
        with httpx.Client(
            base_url=replica.url, timeout=timeout, headers=engine_auth_headers()
        ) as client:
            client.get("/health").raise_for_status()
            models = client.get("/v1/models").raise_for_status().json()
            metrics = engine_metrics_parse(client.get("/metrics").raise_for_status().text)
        cards = [m for m in models.get("data", []) if isinstance(m, dict)]
        names = {m.get("id") for m in cards}
        if served not in names:
            error = f"engine does not serve {served!r} (it serves {sorted(map(str, names))})"
        else:
            # LoRA adapters are the cards with a parent (the base model they apply to).
            loaded = {str(m["id"]) for m in cards if m.get("parent") and m.get("id")}
            error = _progress_check(replica, metrics, round_)
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    previous = replica.state
    replica.last_error = error
    replica.last_probe_at = timezone.now()
    recorded = {"last_error": error, "last_probe_at": replica.last_probe_at}
    state = Replica.State.DOWN if error else Replica.State.READY
    # Draining is decided in the database, not on this copy: an operator or discovery may
    # have drained it while the probe ran (or removed it: then nothing is written).
    rows = Replica.objects.filter(pk=replica.pk)
    if rows.exclude(state=Replica.State.DRAINING).update(state=state, **recorded):
        replica.state = state
    elif rows.update(**recorded):
        replica.state = Replica.State.DRAINING
    if replica.state != previous:
        log.info("replica %s: %s -> %s %s", replica, previous, replica.state, error)
    # A model without LoRA support never has adapters placed on its replicas: nothing to
    # reconcile unless its engine lists some anyway.
    lora = replica.pool.model.supports_lora or bool(loaded)
    if loaded is not None and started_ms is not None and lora:
        # Bookkeeping only: its failure says nothing about the replica's health.
        try:
            _adapters_reconcile(replica, loaded, started_ms, timeout)
        except Exception:
            log.warning("could not reconcile the adapters of %s", replica, exc_info=True)
    if alone:
        round_.end()
    return replica


PROBE_PROGRESS = "ip:probe:progress"  # replica id -> "generated tokens|since (epoch s)"
IDLE = "idle"  # ... or this, while it runs nothing
_CLOCK_AND_PROGRESS = "return {redis.call('TIME'), redis.call('HGETALL', KEYS[1])}"


@dataclass
class ProbeRound:
    """What a round of probes reads of Redis once for all its replicas, and writes once at
    its end: Redis's clock when it began (adapter records newer than that are left alone),
    and each engine's last generated-token count (``_progress_check``). A round costs Redis
    a few commands, not a few per replica. ``None`` where Redis could not say."""

    started_ms: int | None
    progress: dict[str, str] | None
    progress_changed: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def begin(cls) -> ProbeRound:
        try:  # one call, on one Redis or on the progress hash's node of a cluster
            (seconds, micros), raw = cast(
                Any, redis_sync().eval(_CLOCK_AND_PROGRESS, 1, PROBE_PROGRESS)
            )
        except RedisError:
            return cls(started_ms=None, progress=None)
        pairs = cast(list[bytes], raw)
        progress = {k.decode(): v.decode() for k, v in zip(pairs[::2], pairs[1::2], strict=True)}
        return cls(started_ms=int(seconds) * 1000 + int(micros) // 1000, progress=progress)

    def end(self) -> None:
        if self.progress_changed:
            with contextlib.suppress(RedisError):
                redis_sync().hset(PROBE_PROGRESS, mapping=cast(Any, self.progress_changed))
            self.progress_changed = {}


def _progress_check(replica: Replica, metrics: dict[str, float], round_: ProbeRound) -> str:
    """An engine whose HTTP server answers while its engine core is stuck (a hung GPU, a
    wedged kernel) still says 200 on /health: it is down if it has requests running and
    its generated-token counter has not moved for the stall timeout. '' when it is fine."""
    field = str(replica.pk)
    generated, running = metrics["generation"], metrics["running"]
    now = time.time()
    if round_.progress is None:
        return ""  # bookkeeping unavailable: /health decides alone
    text = round_.progress.get(field, "")
    if running == 0:  # nothing to stall; written once, not every round of an idle engine
        if text != IDLE:
            round_.progress_changed[field] = IDLE
        return ""
    last_generated, _, since = text.partition("|")
    try:
        if text == IDLE or not since or float(last_generated) != generated:
            round_.progress_changed[field] = f"{generated}|{now}"  # the stall clock starts
            return ""
    except ValueError:
        round_.progress_changed[field] = f"{generated}|{now}"
        return ""
    silent = now - float(since)
    if silent < settings.INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS:
        return ""
    return (
        f"engine has {running:.0f} requests running and generated nothing for {silent:.0f} s "
        "(its /health still answers: the engine core is stuck)"
    )


_ENGINE_NAME = re.compile(r"^(?P<slug>[^/]+)/(?P<name>[^/:]+):(?P<version>\d+)$")


def _adapters_reconcile(
    replica: Replica, loaded: set[str], started_ms: int, timeout: float
) -> None:
    """After an engine restart its adapters are gone; after a delete they must go. Unload
    what is no longer served (a delete that found the engine away), record the rest."""

    served: set[str] = set()
    for name in loaded:
        match = _ENGINE_NAME.match(name)
        if (
            match
            and Adapter.objects.filter(
                tenant__slug=match["slug"],
                name=match["name"],
                version=int(match["version"]),
                status=Adapter.Status.READY,
                deleted_at__isnull=True,
            ).exists()
        ):
            served.add(name)
        else:
            answer = httpx.post(
                f"{replica.url}/v1/unload_lora_adapter",
                json={"lora_name": name},
                timeout=timeout,
                headers=engine_auth_headers(),
            )
            log.info("unloaded %s from %s (not served): %s", name, replica, answer.status_code)
    redis_sync().eval(
        RECONCILE.source,  # the engine's adapters, made what the router believes
        1,
        adapters_held_key(replica.pool.name, str(replica.pk)),
        started_ms,
        *sorted(served),
    )


def adapter_retire(*, adapter_id: int, force: bool = False) -> bool:
    """A deleted adapter leaves the engines: unloaded from every replica that may hold it
    (requests already running with it finish: vLLM's unload only forgets the name). Its
    files go once no request uses it any more and no other adapter shares them. False
    while a request still runs with it (the task tries again later)."""

    adapter = Adapter.objects.select_related("tenant").filter(pk=adapter_id).first()
    if adapter is None:  # its tenant is gone (and its rows with it)
        return True
    engine_name = f"{adapter.tenant.slug}/{adapter.name}:{adapter.version}"
    client = redis_sync()
    pools: set[str] = set()
    for replica in Replica.objects.select_related("pool"):
        try:
            httpx.post(
                f"{replica.url}/v1/unload_lora_adapter",
                json={"lora_name": engine_name},
                timeout=settings.INFERPLANE_PROBE_TIMEOUT_SECONDS,
                headers=engine_auth_headers(),
            )
        except httpx.HTTPError as exc:  # the engine is away: its next probe unloads it
            log.info("could not unload %s from %s now: %s", engine_name, replica, exc)
        client.zrem(adapters_held_key(replica.pool.name, str(replica.pk)), engine_name)
        pools.add(replica.pool.name)
    busy = any(
        adapter_in_use(p, tenant_id=adapter.tenant_id, engine_name=engine_name) for p in pools
    )
    if busy and not force:
        return False
    adapter_files_remove(adapter=adapter)
    return True


# --- routes (canaries) ---------------------------------------------------------------------

MAX_ROUTE_TARGETS = 8
MAX_ROUTE_WEIGHT = 10_000
_ADAPTER_ADDRESS = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}/[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def model_route_set(
    *, name: str, targets: list[tuple[str, int]], actor: User | None = None
) -> ModelRoute:
    """Point ``name`` at weighted targets (a canary; weights are integers, 0 sends none).
    Every web process follows within a second (the catalog); requests already running keep
    their target. ``name`` is a model's public name (then each target is a model that
    generates text) or a tenant's adapter address ``<slug>/<name>`` (then each target is a
    version of it, ``<slug>/<name>:<version>``). ValidationError, with what is wrong, else."""
    errors = _route_errors(name, targets)
    if errors:
        raise ValidationError(errors)
    before = ModelRoute.objects.filter(name=name).values_list("targets", flat=True).first()
    route, _ = ModelRoute.objects.update_or_create(
        name=name, defaults={"targets": [[target, weight] for target, weight in targets]}
    )
    _platform_audit(actor, "route.set", route, {"before": before, "after": route.targets})
    transaction.on_commit(catalog_publish)
    log.info("route %s -> %s", name, ", ".join(f"{t}={w}" for t, w in targets))
    return route


def model_route_clear(*, name: str, actor: User | None = None) -> bool:
    """Stop routing ``name`` (it is a plain model name again, or unknown). Whether it was."""
    route = ModelRoute.objects.filter(name=name).first()
    if route is None:
        return False
    _platform_audit(actor, "route.clear", route, {"before": route.targets})
    deleted, _ = ModelRoute.objects.filter(name=name).delete()
    if deleted:
        transaction.on_commit(catalog_publish)
    return bool(deleted)


def _route_errors(name: str, targets: list[tuple[str, int]]) -> list[str]:
    errors = []
    adapter_route = "/" in name
    if adapter_route:
        if not _ADAPTER_ADDRESS.match(name):
            errors.append(f"{name!r} is not an adapter address like acme/support-bot.")
    else:
        try:
            name_validator(name)
        except ValidationError:
            errors.append(f"{name!r} is not a model name (letters, digits, '.', '_', ':', '-').")
    if not 1 <= len(targets) <= MAX_ROUTE_TARGETS:
        errors.append(f"Give between 1 and {MAX_ROUTE_TARGETS} targets.")
    names = [target for target, _ in targets]
    if len(set(names)) != len(names):
        errors.append("Name each target once.")
    for target, weight in targets:
        if not (isinstance(weight, int) and 0 <= weight <= MAX_ROUTE_WEIGHT):
            errors.append(f"{target}: the weight must be a whole number from 0 to 10000.")
    if targets and sum(weight for _, weight in targets) <= 0:
        errors.append("At least one target needs a weight above 0.")
    if errors:
        return errors
    if adapter_route:
        slug, _, adapter = name.partition("/")
        versions = set(
            Adapter.objects.filter(
                tenant__slug=slug,
                name=adapter,
                status=Adapter.Status.READY,
                deleted_at__isnull=True,
            ).values_list("version", flat=True)
        )
        for target in names:
            address, _, version = target.partition(":")
            if address != name or not version.isdigit() or int(version) not in versions:
                errors.append(f"{target}: not a ready version of {name} ({name}:<version>).")
        return errors
    models = dict(Model.objects.filter(name__in=names).values_list("name", "task"))
    for target in names:
        if target not in models:
            errors.append(f"{target}: no such model.")
        elif models[target] != Model.Task.GENERATE:
            errors.append(f"{target}: a classification model cannot answer completions.")
    return errors


def response_cache_forget(*, tenant_id: int) -> int:
    """Every answer in the tenant's response cache gone at once; how many there were (0, and
    a warning, when Redis cannot be reached: the answers then expire with their TTL)."""
    try:
        return int(redis_sync().eval(cache.PURGE.source, 1, cache.prefix(tenant_id)))
    except RedisError:
        log.warning("could not empty the response cache of tenant %s", tenant_id, exc_info=True)
        return 0


def response_cache_purge(*, tenant: Tenant, actor: User | None) -> int:
    """Every answer in the tenant's response cache gone at once; how many there were. Raises
    RedisError when Redis cannot be reached (nothing purged)."""
    purged = int(redis_sync().eval(cache.PURGE.source, 1, cache.prefix(tenant.pk)))
    audit_record(
        actor=actor, tenant=tenant, action="cache.purge", target=tenant, details={"purged": purged}
    )
    return purged
