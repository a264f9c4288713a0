"""A pool's replicas from DNS (``Pool.discovery_url``): each resolution adds the addresses that
appeared and removes those gone (a replica with requests in flight drains first)."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import re
import socket
from dataclasses import dataclass

import dns.exception
import dns.resolver
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from fleet.models import (
    Pool,
    Replica,
)
from inference.catalog import catalog_publish
from inference.selectors import replicas_in_flight
from inference.services.fleet import pool_locked, replica_create, replica_delete

log = logging.getLogger(__name__)


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
    pool = pool_locked(pool)
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
        result.added.append(replica_create(pool=pool, url=url, discovered=True).name)
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
                replica_delete(replica)
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
