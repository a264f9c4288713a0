"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, and the
fixed set of kinds the gateway's metrics count them by (``ApiError.kind``)."""

from __future__ import annotations

from typing import Any

import orjson

# Every kind an error is counted as (``inferplane_request_errors_total{type}``): a fixed set,
# so a client can never mint a label value.
ERROR_KINDS = (
    "auth",
    "rate_limited",
    "queue_timeout",
    "overloaded",
    "upstream",
    "adapter_load",
    "client_disconnect",
    "invalid_request",
    "content_filter",
    "internal",
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}
        self._kind = kind

    @property
    def kind(self) -> str:
        """What went wrong, for the metrics: one of ``ERROR_KINDS``. Said where the error is
        made when its status does not tell (a queue wait, an adapter's load); else derived."""
        if self._kind:
            return self._kind
        if self.code == "content_policy_violation":
            return "content_filter"
        if self.status in (401, 403):
            return "auth"
        if self.status == 429:
            return "rate_limited"
        if self.status == 503:
            return "overloaded"
        if self.status == 500:
            return "internal"
        if self.status >= 500:
            return "upstream"
        return "invalid_request"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def json(self) -> bytes:
        return orjson.dumps(self.body())


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def invalid_api_key(presented: str) -> ApiError:
    shown = presented[:10] + "…" + presented[-4:] if len(presented) > 16 else "(hidden)"
    return ApiError(
        401,
        f"Incorrect API key provided: {shown}. Create or copy a key in your Inferplane dashboard.",
        code="invalid_api_key",
    )


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


# The error code of a lent call whose room an online request took back (``run_whole``).
LENT_RECLAIMED = "lent_capacity_reclaimed"


def lent_reclaimed() -> ApiError:
    """A batch line's lent room taken back: it runs again (nothing of it is billed)."""
    return ApiError(
        503,
        "The online pool took back the idle room this batch line borrowed; it runs again.",
        type="server_error",
        code=LENT_RECLAIMED,
    )


def overloaded(
    retry_after: int, message: str | None = None, *, kind: str | None = None
) -> ApiError:
    return ApiError(
        503,
        message or "The pool is at capacity and your request waited too long. Retry later.",
        type="server_error",
        code="overloaded",
        headers={"retry-after": str(retry_after)},
        kind=kind,
    )
