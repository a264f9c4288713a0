"""Writes for models, pools, replicas and routes, one module per concern: ``fleet`` (models,
pools and replicas), ``discovery`` (a pool's replicas from DNS), ``probes`` (the health
probe and the adapters it reconciles), ``routes`` (a model name's canary targets),
``response_cache`` (a tenant's response cache emptied). Callers import from here."""

from inference.services.discovery import DiscoveryRound, DnsFailure, pool_discovery_sync
from inference.services.fleet import (
    model_ensure,
    pool_configure,
    pool_ensure,
    replica_add,
    replica_drain,
    replica_name_assign,
    replica_remove,
    replica_set_state,
    replica_undrain,
)
from inference.services.probes import ProbeRound, adapter_retire, replica_probe
from inference.services.response_cache import response_cache_forget, response_cache_purge
from inference.services.routes import MAX_ROUTE_WEIGHT, model_route_clear, model_route_set

__all__ = [
    "MAX_ROUTE_WEIGHT",
    "DiscoveryRound",
    "DnsFailure",
    "ProbeRound",
    "adapter_retire",
    "model_ensure",
    "model_route_clear",
    "model_route_set",
    "pool_configure",
    "pool_discovery_sync",
    "pool_ensure",
    "replica_add",
    "replica_drain",
    "replica_name_assign",
    "replica_probe",
    "replica_remove",
    "replica_set_state",
    "replica_undrain",
    "response_cache_forget",
    "response_cache_purge",
]
