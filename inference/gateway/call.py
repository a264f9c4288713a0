"""A call: one request in the gateway, from admission to its record, and the state machine it
moves through (``State``). Every phase takes it: ``prepare`` makes it, ``Relay`` streams its
answer (``whole`` takes a whole one), ``settle.finish`` meters and releases it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from contract import (
    CatalogReplica,
    PriceRow,
    UsageRecord,
)
from inference.gateway import limits
from inference.gateway.auth import KeyInfo
from inference.gateway.cache import Ticket
from inference.gateway.schema import (
    ParsedRequest,
)
from tenants.priority import DEFAULT_CLASS


class MidStreamError(Exception):
    """The engine failed after the response had started."""


class State(enum.Enum):
    """Where a call is. ``PREPARED`` (limits taken, admitted to a replica) → ``STREAMING``
    (the engine answered) → ``DONE`` (its ``[DONE]`` came); or, from either live state,
    ``FAILED`` (the engine or the gateway failed), ``CUT_OFF`` (the client left) or
    ``FILTERED`` (an output filter or input check stopped it, ``inference.gateway.seams``). A
    complete answer can still fail to reach the client whole (``DONE`` → ``FAILED`` | ``FILTERED``).
    Every ending is then ``SETTLED``: metered and released, once (``finish``)."""

    PREPARED = "prepared"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"
    CUT_OFF = "cut_off"
    FILTERED = "filtered"
    SETTLED = "settled"

    @property
    def live(self) -> bool:
        return self in _LIVE


_LIVE = frozenset({State.PREPARED, State.STREAMING})
_ENDINGS = frozenset({State.FAILED, State.CUT_OFF, State.FILTERED})
_NEXT: dict[State, frozenset[State]] = {
    State.PREPARED: frozenset({State.STREAMING, *_ENDINGS}),
    State.STREAMING: frozenset({State.DONE, *_ENDINGS}),
    State.DONE: frozenset({State.FAILED, State.FILTERED, State.SETTLED}),
    State.FAILED: frozenset({State.SETTLED}),
    State.CUT_OFF: frozenset({State.SETTLED}),
    State.FILTERED: frozenset({State.SETTLED}),
    State.SETTLED: frozenset(),
}
# The usage ledger's status for each way a call ends (billing.models.UsageRecord.Status).
LEDGER_STATUS = {
    State.DONE: "ok",
    State.FAILED: "error",
    State.CUT_OFF: "cut_off",
    State.FILTERED: "content_filter",
}


class IllegalTransition(RuntimeError):
    """A call was asked to move where its state machine does not go (a bug, not an input)."""


@dataclass(slots=True)
class Route:
    """Where a call runs: its pool, the replica admission gave it, the one last tried."""

    pool: str
    replicas: dict[str, CatalogReplica]  # the pool's replicas, from the catalog, by id
    replica: str
    replica_url: str = ""
    tried: str = ""  # the replica last sent to (the one that failed, if none is left)
    adapter_replica: str = ""  # the replica counting this request as using the adapter
    max_loras: int = 1  # adapters one replica of the pool holds at once
    # The priority its engine schedules it at (vLLM's, lower first), on a pool whose engines
    # schedule by priority (one that lends); None: the engine is not told.
    engine_priority: int | None = None
    # It runs on room an online pool lent it (a batch line): taken back when online
    # requests need it (``Admission.borrow``).
    lent: bool = False


@dataclass(slots=True)
class Counts:
    """The engine's counts so far, summed over the request's sequences, and how much of
    the output admission has been charged already."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    progressed: int = 0
    ttft_ms: int | None = None


@dataclass(slots=True)
class Call:
    rid: str
    key: KeyInfo
    parsed: ParsedRequest
    route: Route
    served_name: str
    grant: limits.Grant
    body: bytes
    started_at: datetime
    t0: float
    headers: list[tuple[bytes, bytes]]
    counts: Counts = field(default_factory=Counts)
    state: State = State.PREPARED
    error: str = ""
    rates: PriceRow | None = None  # the price in force at the start
    base_model: str = ""  # the model billed: the base model under an adapter
    adapter: Adapter | None = None
    mode: str = "online"  # or "batch": billed at the batch discount
    # Where the usage record goes instead of the spool: a batch worker stores it with the
    # line's result, in one transaction (see ``batches``).
    ledger: Callable[[UsageRecord], None] | None = None
    # The engine answers whole, not streamed (a batch line: nobody watches it arrive, and a
    # whole answer costs the engine and us less per token); see ``whole.post_whole``.
    whole: bool = False
    # What a failure is counted as in the metrics when the ledger status does not tell
    # (``errors.ERROR_KINDS``; empty: by status, see ``metrics.request_settled``).
    error_kind: str = ""
    # The routed name asked for, when a route (a canary) picked this call's target.
    routed_name: str = ""
    queue_wait: float = 0.0  # seconds it waited for admission
    # Work done for the call beside its engine (its guard's checks), as (tokens, their cost):
    # counted toward its limits and budgets when it is settled; billed on records of its own.
    beside: tuple[int, int] = (0, 0)
    # Its dealings with the tenant's response cache (``cache.Ticket``); None: no cache.
    cache: Ticket | None = None
    priority: str = DEFAULT_CLASS  # the class it was admitted in (``gateway.priority``)
    # Its lent room was taken back and its work aborted (``headless.run_whole``): nothing of
    # it counts toward the tenant's limits or budgets (it runs again, and is billed then).
    reclaimed: bool = False

    def _move(self, to: State) -> None:
        if to not in _NEXT[self.state]:
            raise IllegalTransition(f"call {self.rid}: {self.state.name} -> {to.name}")
        self.state = to

    def streaming(self) -> None:
        """The engine answered: its first event is in."""
        self._move(State.STREAMING)

    def end(self) -> None:
        """The engine's answer is complete (its ``[DONE]``, or the end of its stream)."""
        self._move(State.DONE)

    def fail(self, error: str, *, outcome: State = State.FAILED) -> None:
        """The one place a call's outcome other than ``DONE`` is set: ``FAILED`` (the engine
        or the gateway failed), ``CUT_OFF`` (the client left first) or ``FILTERED``.
        ``settle()`` decides for a call that ended without any."""
        if outcome not in _ENDINGS:
            raise IllegalTransition(f"call {self.rid}: {outcome.name} is not a failure")
        self._move(outcome)
        self.error = error[:300]

    def note(self, error: str) -> None:
        """What went wrong on the way (a replica that failed before another one answered),
        kept with the record whatever the outcome."""
        self.error = error[:300]

    def settle(self, *, cancelled: bool) -> str | None:
        """Mark the call settled; its ledger status, or None if it was settled already. A
        call still live here ended before the engine's ``[DONE]`` with nothing noted: the
        client left (``cancelled``: a cut-off, billed for what was made), or the transport
        stopped reading for its own reason (an error)."""
        if self.state is State.SETTLED:
            return None
        if self.state.live:
            self.fail(self.error, outcome=State.CUT_OFF if cancelled else State.FAILED)
        status = LEDGER_STATUS[self.state]
        self._move(State.SETTLED)
        return status

    @property
    def replica_name(self) -> str:
        """The replica as tenants and the ledger know it (never its internal address)."""
        route = self.route
        replica = route.replica or route.tried
        known = route.replicas.get(replica)
        return known.name if known is not None and known.name else f"replica {replica}"

    def usage(self) -> dict[str, Any]:
        counts = self.counts
        return {
            "prompt_tokens": counts.prompt,
            "completion_tokens": counts.completion,
            "total_tokens": counts.prompt + counts.completion,
            "prompt_tokens_details": {"cached_tokens": counts.cached},
        }


@dataclass(frozen=True, slots=True)
class Adapter:
    """A tenant's LoRA adapter a request asked for (``<tenant-slug>/<name>[:version]``)."""

    engine_name: str  # what the engines know it as: ``<slug>/<name>:<version>``
    label: str  # ``<name>:<version>``, in the usage ledger
    path: str  # where the engines load it from
