"""Helpers for management commands: one clear line on bad input, never a traceback."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError


def parse_positive_int(
    value: str | None, *, option: str, maximum: int, minimum: int = 1
) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise CommandError(f"{option} must be a whole number, not {value!r}") from None
    if not minimum <= number <= maximum:
        raise CommandError(f"{option} must be between {minimum} and {maximum}, not {number}")
    return number


def validation_message(exc: ValidationError) -> str:
    if hasattr(exc, "message_dict"):
        return "; ".join(
            f"{field}: {' '.join(msgs)}" if field != "__all__" else " ".join(msgs)
            for field, msgs in exc.message_dict.items()
        )
    return " ".join(exc.messages)
