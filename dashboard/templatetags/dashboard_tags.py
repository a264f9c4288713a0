from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from django import template

from billing.pricing import micros_to_usd

register = template.Library()


@register.filter
def cents(value: int | None) -> str:
    """12345 -> "$123.45" (an invoice amount)."""
    amount = int(value or 0)
    sign = "-" if amount < 0 else ""
    whole, rest = divmod(abs(amount), 100)
    return f"{sign}${whole:,}.{rest:02d}"


@register.filter
def usd(micros: int | None) -> str:
    """Micro-dollars as exact dollars, the ledger's precision (1234567 -> "1.234567")."""
    return micros_to_usd(int(micros or 0))


@register.filter
def money(micros: int | None) -> str:
    """Micro-dollars to the precision they have: whole cents as cents ("$4.50", "$1,204.00"),
    anything finer to its last digit ("$0.0018", "$12.345678"), never rounded to "$0.00"."""
    amount = int(micros or 0)
    sign = "-" if amount < 0 else ""
    whole, frac = divmod(abs(amount), 1_000_000)
    decimals = f"{frac:06d}".rstrip("0").ljust(2, "0")
    return f"{sign}${whole:,}.{decimals}"


@register.filter
def plain(value: Decimal | None) -> str:
    """A stored decimal without its padding zeros, never in exponent form: 10.000000 -> "10",
    0.150000 -> "0.15" (``normalize`` alone writes 10 as "1E+1")."""
    return "" if value is None else format(value.normalize(), "f")


@register.filter
def seconds(value: float | None) -> str:
    """A duration to the millisecond, without trailing zeros: 0.75 -> "0.75", 1.0 -> "1"."""
    return f"{float(value or 0):.3f}".rstrip("0").rstrip(".")


@register.filter
def as_json(value: Any, indent: int | None = None) -> str:
    """An audit entry's details as JSON (what the API returns), not Python's repr; ``indent``
    for the whole value, shown when the row is opened. Escaped by the template like any text."""
    if value in (None, "", {}):
        return ""
    return json.dumps(value, indent=indent, ensure_ascii=False, sort_keys=True, default=str)
