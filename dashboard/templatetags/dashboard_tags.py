from __future__ import annotations

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
