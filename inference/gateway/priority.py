"""A request's priority class: the key's, or a lower one the request asks for with OpenAI's
``service_tier`` (``priority``, ``default``, ``flex``; ``auto``: the key's) or with one of the
classes' own names. Never a higher one: the tenant's tier is the operator's to set
(docs/priority.md). Batch lines always run in the lowest band."""

from __future__ import annotations

from inference.gateway.auth import KeyInfo
from inference.gateway.errors import ApiError, invalid_request
from tenants.priority import BATCH_CLASS, PRIORITY_CLASSES, SERVICE_TIERS, band


def request_class(key: KeyInfo, asked: object, *, mode: str) -> str:
    """The class a request runs in; ``asked``: its ``service_tier`` (None when absent)."""
    if mode == "batch":
        return BATCH_CLASS
    if asked is None or asked == "auto":
        return key.priority
    name = SERVICE_TIERS.get(str(asked), str(asked))
    if name not in PRIORITY_CLASSES:
        tiers = ", ".join(["auto", *SERVICE_TIERS, *PRIORITY_CLASSES])
        raise invalid_request(
            f"service_tier must be one of {tiers}; got {str(asked)[:40]!r}.",
            param="service_tier",
            code="invalid_service_tier",
        )
    if band(name) < band(key.priority):
        raise ApiError(
            403,
            f"This API key's requests run in the '{key.priority}' priority class at most; "
            f"service_tier {asked!r} asks for '{name}', above it. Ask your tenant's admin "
            "for a key of a higher class, or send a lower service_tier.",
            type="permission_error",
            param="service_tier",
            code="priority_not_allowed",
        )
    return name
