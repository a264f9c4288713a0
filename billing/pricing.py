"""Prices and costs: the arithmetic of the ledger, in one place.

Unit: a price per 1M tokens in dollars is the price of one token in micro-dollars, so a
record's cost in micro-dollars is the sum of its token counts times the prices, as an
exact ``Decimal``, rounded once (half up) to a whole micro-dollar. Prompt tokens served
from the prefix cache are charged at the cached-input price, the rest at the input price.
Batch-mode records get the price's batch discount on the whole amount before rounding; online
records of the interactive class its interactive surcharge, of the background class its
background discount (docs/priority.md), the same way.
The price is the one in force when the request started: the tenant's contract price if it
has one in force then, otherwise the list price.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal

from billing.models import Price, UsageRecord
from contract import PriceRow, Prices
from contract import UsageRecord as ContractRecord

MICROS_PER_USD = 1_000_000
_ONE = Decimal(1)
_HUNDRED = Decimal(100)


def cost_micros(
    *,
    input_per_mtok: Decimal,
    cached_input_per_mtok: Decimal,
    output_per_mtok: Decimal,
    batch_discount_percent: Decimal,
    batch: bool,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    priority: str = "standard",
    interactive_surcharge_percent: Decimal = Decimal(0),
    background_discount_percent: Decimal = Decimal(0),
) -> int:
    cached = min(max(cached_tokens, 0), prompt_tokens)
    amount = (
        (prompt_tokens - cached) * input_per_mtok
        + cached * cached_input_per_mtok
        + completion_tokens * output_per_mtok
    )
    if batch:  # a batch line is priced as batch work, whatever its class
        percent = -batch_discount_percent
    elif priority == "interactive":
        percent = interactive_surcharge_percent
    elif priority == "background":
        percent = -background_discount_percent
    else:
        percent = Decimal(0)
    if percent:
        amount = amount * (_HUNDRED + percent) / _HUNDRED
    return int(amount.quantize(_ONE, rounding=ROUND_HALF_UP))


def price_of(
    rates: PriceRow | None,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    batch: bool = False,
    priority: str = "standard",
) -> int:
    """What tokens cost at a price row of the catalog (``contract.price_in_force``), for the
    gateway's spend budgets; the ledger fixes the billed cost itself, with the same
    arithmetic."""
    if rates is None:
        return 0
    return cost_micros(
        input_per_mtok=rates.input_per_mtok,
        cached_input_per_mtok=rates.cached_input_per_mtok,
        output_per_mtok=rates.output_per_mtok,
        batch_discount_percent=rates.batch_discount_percent,
        batch=batch,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
        priority=priority,
        interactive_surcharge_percent=rates.interactive_surcharge_percent,
        background_discount_percent=rates.background_discount_percent,
    )


def usage_cost_micros(
    *,
    price: Price,
    mode: str,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    priority: str = "standard",
) -> int:
    return cost_micros(
        input_per_mtok=price.input_per_mtok,
        cached_input_per_mtok=price.cached_input_per_mtok,
        output_per_mtok=price.output_per_mtok,
        batch_discount_percent=price.batch_discount_percent,
        batch=mode == UsageRecord.Mode.BATCH,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
        priority=priority,
        interactive_surcharge_percent=price.interactive_surcharge_percent,
        background_discount_percent=price.background_discount_percent,
    )


def micros_to_usd(micros: int) -> str:
    """Micro-dollars as a dollar amount with six decimals (exact), e.g. ``0.001234``."""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS_PER_USD)
    return f"{sign}{whole}.{frac:06d}"


class PriceBook:
    """The prices of some models, loaded once, answering "what did this cost then?"."""

    def __init__(self, prices: Iterable[Price]) -> None:
        # (model name, tenant id or None) -> prices sorted by effective_from
        self._by: dict[tuple[str, int | None], list[Price]] = defaultdict(list)
        for price in prices:
            self._by[(price.model.name, price.tenant_id)].append(price)
        self._starts: dict[tuple[str, int | None], list[datetime]] = {}
        for key, rows in self._by.items():
            rows.sort(key=lambda p: p.effective_from)
            self._starts[key] = [p.effective_from for p in rows]

    @classmethod
    def for_models(cls, names: Iterable[str]) -> PriceBook:
        return cls(Price.objects.filter(model__name__in=set(names)).select_related("model"))

    def _in_force(self, key: tuple[str, int | None], at: datetime) -> Price | None:
        starts = self._starts.get(key)
        if not starts:
            return None
        i = bisect_right(starts, at)
        return self._by[key][i - 1] if i else None

    def price_for(self, *, model: str, tenant_id: int, at: datetime) -> Price | None:
        return self._in_force((model, tenant_id), at) or self._in_force((model, None), at)

    def cost_micros(self, record: UsageRecord | ContractRecord) -> int | None:
        """The record's cost, or None when no price was in force for it."""
        price = self.price_for(model=record.model, tenant_id=record.tenant_id, at=record.started_at)
        if price is None:
            return None
        return usage_cost_micros(
            price=price,
            mode=record.mode,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens,
            priority=record.priority,
        )


def prices_for_catalog(*, at: datetime) -> dict[str, Prices]:
    """Per model name, the list and contract prices in force at ``at`` or later, for the
    gateway to count spend against budgets (``contract.Prices``)."""
    out: dict[str, dict[str, list[PriceRow]]] = defaultdict(lambda: defaultdict(list))
    for price in Price.objects.select_related("model").order_by("effective_from"):
        scope = f"tenant:{price.tenant_id}" if price.tenant_id else "list"
        out[price.model.name][scope].append(
            PriceRow(
                starts=price.effective_from.timestamp(),
                input_per_mtok=price.input_per_mtok,
                cached_input_per_mtok=price.cached_input_per_mtok,
                output_per_mtok=price.output_per_mtok,
                batch_discount_percent=price.batch_discount_percent,
                interactive_surcharge_percent=price.interactive_surcharge_percent,
                background_discount_percent=price.background_discount_percent,
            )
        )
    # Keep only what can still apply: the last price started before ``at`` and later ones.
    cut = at.timestamp()
    for scopes in out.values():
        for scope, rows in scopes.items():
            current = [r for r in rows if r.starts <= cut][-1:]
            scopes[scope] = current + [r for r in rows if r.starts > cut]
    return {name: dict(scopes) for name, scopes in out.items()}
