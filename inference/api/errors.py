"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

import orjson


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

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


def overloaded(retry_after: int, message: str | None = None) -> ApiError:
    return ApiError(
        503,
        message or "The pool is at capacity and your request waited too long. Retry later.",
        type="server_error",
        code="overloaded",
        headers={"retry-after": str(retry_after)},
    )
