"""Writes for models, pools and replicas: created, configured, named, drained, removed (each
change recorded in the platform's audit log and published to the serving catalog)."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.db import transaction
from redis.exceptions import RedisError

from controlplane.redis import redis_sync
from fleet.models import (
    Model,
    Pool,
    Replica,
    dns_name_validator,
    engine_url_validator,
    name_validator,
)
from inference.catalog import adapters_held_key, catalog_publish, pool_prefix
from inference.selectors import replica_in_flight
from inference.services.probes import replica_probe
from tenants.models import User
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
    pool = pool_locked(pool)
    if discovery is not None:
        _discovery_apply(pool, discovery)
        pool.full_clean()
        pool.save()
    managed = pool.replicas.all()
    if pool.discovery == Pool.Discovery.DNS:
        managed = managed.filter(discovered=False)
    for replica in managed.exclude(url__in=urls):
        replica_delete(replica)
    for url in urls:
        if not pool.replicas.filter(url=url).exists():
            replica_create(pool=pool, url=url)
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
        platform_audit(actor, "pool.configure", pool, changed)
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


def platform_audit(
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


def pool_locked(pool: Pool) -> Pool:
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
    replica.name = _replica_name_next(pool_locked(replica.pool))
    return replica


def replica_create(*, pool: Pool, url: str, name: str = "", discovered: bool = False) -> Replica:
    """A new replica (``pool`` locked by the caller), named ``<pool>-<n>`` unless given a
    name. Numbers are never reused: the ledger names replicas, old names stay meaningful."""
    replica = Replica(
        pool=pool, url=url, name=name or _replica_name_next(pool), discovered=discovered
    )
    replica.full_clean()
    replica.save()
    return replica


def replica_delete(replica: Replica) -> None:
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
    pool = pool_locked(pool)
    url = url.strip().rstrip("/")
    try:
        engine_url_validator(url)
    except ValidationError as exc:
        raise ValidationError({"url": exc.messages}) from None
    if pool.replicas.filter(url=url).exists():
        raise ValidationError({"url": f"{url} is already a replica of pool {pool.name}"})
    if name and pool.replicas.filter(name=name).exists():
        raise ValidationError({"name": f"pool {pool.name} already has a replica named {name}"})
    replica = replica_create(pool=pool, url=url, name=name)
    platform_audit(actor, "replica.add", replica, {"pool": pool.name, "url": url})
    transaction.on_commit(catalog_publish)
    log.info("replica %s (%s) added to pool %s", replica.name, url, pool.name)
    return replica


def replica_drain(*, replica: Replica, actor: User | None = None) -> Replica:
    """No new requests go to it; the ones running finish. Probes leave it draining."""
    with transaction.atomic():
        replica = replica_set_state(replica=replica, state=Replica.State.DRAINING)
        platform_audit(actor, "replica.drain", replica, {"pool": replica.pool.name})
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
    platform_audit(
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
    platform_audit(
        actor,
        "replica.remove",
        replica,
        {"pool": replica.pool.name, "url": replica.url, "in_flight": in_flight, "force": force},
    )
    replica_delete(replica)
    transaction.on_commit(catalog_publish)
    log.info("replica %s removed (%d in flight)", name, in_flight)
    return in_flight
