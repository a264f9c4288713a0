"""What the control plane and the gateway exchange, typed: the serving catalog (models, pools,
replicas, adapters, prices) and the usage record.

The control plane builds the catalog from Postgres and publishes it to Redis as JSON
(``inference.catalog``); every web process decodes it into these structures
(``inference.gateway.catalog``), validated on the way in. The gateway writes one ``UsageRecord``
per request to the usage stream; billing decodes it into the same structure and stores it
(``billing.spool``, ``billing.services``). Both sides use this module and nothing else to
agree: it imports no app, and the layers contract in pyproject.toml keeps it at the bottom.

msgspec does the encoding and decoding: structures declared once, checked on decode (a
catalog that does not match is refused whole, never half-read), and faster than building
dicts. The JSON on the wire is what the dict-based code wrote before.

Which models a tenant may call is decided here, in ``Catalog.callable_by``, and nowhere
else: the gateway routes with it, ``/v1/models`` lists it, the dashboard's playground offers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

import msgspec


class PriceRow(msgspec.Struct, frozen=True, array_like=True):
    """A price from ``starts`` (epoch seconds) on, per 1M tokens in dollars."""

    starts: float
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    batch_discount_percent: Decimal
    # The priority classes' prices (a catalog published before they existed has none).
    interactive_surcharge_percent: Decimal = Decimal(0)
    background_discount_percent: Decimal = Decimal(0)


# Per scope — "list", or "tenant:<id>" for a contract price — the rows still applicable,
# sorted by start: the one in force when the catalog was built, then those to come.
Prices = dict[str, list[PriceRow]]


def price_in_force(prices: Prices, *, tenant_id: int, at: float) -> PriceRow | None:
    """The row in force at epoch ``at`` for the tenant: its contract price, else the list
    price; None when neither has started."""
    for scope in (f"tenant:{tenant_id}", "list"):
        found = None
        for row in prices.get(scope, ()):
            if row.starts <= at:
                found = row
        if found is not None:
            return found
    return None


class CatalogModel(msgspec.Struct, frozen=True):
    served_name: str  # what the engines call it
    context_length: int
    supports_lora: bool
    is_public: bool
    allowed_tenants: frozenset[int]  # who else may call it, when it is not public
    created: int  # epoch seconds, for /v1/models
    accepts_images: bool = False
    accepts_audio: bool = False
    online_pool: str | None = None  # a dedicated pool serving it, for /v1
    batch_pool: str | None = None  # a spot pool serving it, for batch jobs
    prices: Prices = {}
    # "classify": a guard model, reached only through moderation; "embed": /v1/embeddings only
    task: str = "generate"

    def open_to(self, tenant_id: int) -> bool:
        return self.is_public or tenant_id in self.allowed_tenants


class CatalogReplica(msgspec.Struct, frozen=True):
    url: str  # internal: never shown to tenants
    state: str  # ready | draining | down
    name: str  # what tenants and the ledger call it


class CatalogPool(msgspec.Struct, frozen=True):
    kind: str  # dedicated | spot
    model: str
    policy: str  # vtc | fcfs
    max_inflight: int  # sequences per replica
    max_queue_wait_seconds: float
    replicas: dict[str, CatalogReplica]  # by replica id
    max_loras: int = 1  # adapters one replica holds at once
    # The percent of its capacity an online pool lends batch lines while idle (0: none).
    lend_percent: int = 0


class AdapterVersion(msgspec.Struct, frozen=True):
    engine_name: str  # ``<slug>/<name>:<version>``
    path: str  # where the engines load it from ("" while storage has no local copy)
    model: str  # its base model


class CatalogAdapter(msgspec.Struct, frozen=True):
    tenant: int  # the only tenant that may call it
    created: int
    latest: int  # the version ``<slug>/<name>`` without one means
    versions: dict[str, AdapterVersion]


@dataclass(frozen=True, slots=True)
class Servable:
    """A name a tenant may send as ``model``: a base model, or one of its adapters on one."""

    name: str
    created: int
    owned_by: str  # "inferplane" for a base model, the tenant's slug for its adapter
    base: str  # the base model's name: the one billed
    model: CatalogModel
    pool: str | None  # the pool of the kind asked for that serves it; None: none right now
    adapter: AdapterVersion | None = None


class Catalog(msgspec.Struct, frozen=True):
    version: int  # time.time_ns() when built: newer wins
    models: dict[str, CatalogModel]
    pools: dict[str, CatalogPool]
    adapters: dict[str, CatalogAdapter] = {}
    # A routed name -> its targets with their integer weights (fleet.models.ModelRoute).
    routes: dict[str, list[tuple[str, int]]] = {}

    def route(self, name: str, draw: float) -> str:
        """The target a request for ``name`` runs on: by weight, ``draw`` in [0, 1) picking
        (``random.random()``); ``name`` itself when it is not routed."""
        targets = self.routes.get(name)
        if not targets:
            return name
        total = sum(weight for _, weight in targets)
        point = draw * total
        for target, weight in targets:
            if point < weight:
                return target
            point -= weight
        return next(target for target, weight in reversed(targets) if weight)

    def callable(
        self, name: str, tenant_id: int, *, kind: str = "online", routed: bool = True
    ) -> Servable | None:
        """Whether the tenant may send ``name`` as ``model``, and what it then calls: a base
        model open to it (public, or allowed to it), or its own adapter on one —
        ``<slug>/<name>`` for the newest version, ``<slug>/<name>:<version>`` for one.
        Another tenant's adapter is as unknown as one that does not exist. ``kind`` says
        which pool to name: ``online`` (dedicated) or ``batch`` (spot). The one place this
        is decided. A routed name (``routes``) is what its heaviest target is: a request
        picks its own target first (``route``) and asks for that with ``routed=False``."""
        asked = name
        if routed and name in self.routes:
            name = max(self.routes[name], key=lambda target: target[1])[0]
        adapter, entry, base = None, None, name
        if "/" in name:
            address, _, version = name.partition(":")
            entry = self.adapters.get(address)
            if entry is None or entry.tenant != tenant_id or name.endswith(":"):
                return None
            adapter = entry.versions.get(version or str(entry.latest))
            if adapter is None:
                return None
            base = adapter.model
        model = self.models.get(base)
        if model is None or not model.open_to(tenant_id):
            return None
        pool = model.online_pool if kind == "online" else model.batch_pool
        if entry is None:
            return Servable(asked, model.created, "inferplane", base, model, pool)
        owner = name.partition("/")[0]
        return Servable(asked, entry.created, owner, base, model, pool, adapter)

    def lender(self, name: str, tenant_id: int) -> str | None:
        """The online pool that lends idle room to batch lines calling ``name`` (the one its
        online requests run on, when it lends: ``CatalogPool.lend_percent``), or None."""
        online = self.callable(name, tenant_id)
        pool = self.pools.get(online.pool) if online is not None and online.pool else None
        return online.pool if online is not None and pool and pool.lend_percent else None

    def callable_by(self, tenant_id: int, *, kind: str = "online") -> dict[str, Servable]:
        """Every name the tenant can call right now (a pool of that kind serves it): the base
        models, then its adapters (for each, the newest by its address, then each version)."""
        names = [*self.models, *(name for name in self.routes if name not in self.models)]
        for address, entry in self.adapters.items():
            if entry.tenant == tenant_id:
                for version in entry.versions:
                    if int(version) == entry.latest:
                        names.append(address)
                    names.append(f"{address}:{version}")
        found = {}
        for name in names:
            call = self.callable(name, tenant_id, kind=kind)
            if call is not None and call.pool is not None:
                found[name] = call
        return found


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One request's usage, as the gateway meters it and the ledger stores it (the defaults
    are the ledger's own)."""

    request_id: str  # the ledger is idempotent on it
    tenant_id: int
    api_key_id: int | None = None
    model: str  # the base model billed
    adapter: str = ""  # ``<name>:<version>`` of the tenant's adapter, if one served it
    route: str = ""  # the routed name asked for (a canary), when a route picked the target
    endpoint: str  # chat.completions | completions
    mode: str = "online"  # online | batch
    status: str  # ok | error | cut_off | ...
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    pool: str = ""
    replica: str = ""  # its name, never its address
    ttft_ms: int | None = None
    duration_ms: int = 0
    error: str = ""
    started_at: datetime
    finished_at: datetime
    priority: str = "standard"  # the priority class it ran in (tenants.priority)
    cost_micros: int | None = None  # fixed by the ledger at insert when absent


catalog_decoder = msgspec.json.Decoder(Catalog)
usage_decoder = msgspec.json.Decoder(UsageRecord)
encode = msgspec.json.Encoder().encode
