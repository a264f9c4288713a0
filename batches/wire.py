"""OpenAI's Batch API shapes: the batch object, a line's error body, an output file's line.
Nothing here changes state."""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from batches.models import Batch, Line, epoch
from batches.selectors import batch_line_counts, batch_usage

ENDPOINTS = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}


def batch_object(batch: Batch) -> dict[str, Any]:
    """The batch in OpenAI's shape, with live counts and usage (a field without a value is
    left out, as OpenAI's schema has it: the SDKs read it as None)."""
    shaped = {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": epoch(batch.created_at),
        "in_progress_at": epoch(batch.in_progress_at),
        "expires_at": epoch(batch.expires_at),
        "finalizing_at": epoch(batch.finalizing_at),
        "completed_at": epoch(batch.completed_at),
        "failed_at": epoch(batch.failed_at),
        "expired_at": epoch(batch.expired_at),
        "cancelling_at": epoch(batch.cancelling_at),
        "cancelled_at": epoch(batch.cancelled_at),
        "request_counts": batch.kept["request_counts"] if batch.kept else batch_line_counts(batch),
        "usage": batch.kept["usage"] if batch.kept else batch_usage(batch),
        "metadata": batch.metadata,
    }
    return {name: value for name, value in shaped.items() if value is not None}


def error_body(code: str) -> dict[str, Any]:
    messages = {
        "batch_cancelled": "The batch was cancelled before this request ran.",
        "batch_expired": "The batch expired before this request completed.",
    }
    return {"code": code, "message": messages[code]}


def output_line(line: Line, response: str | None) -> bytes:
    """One line of an output or error file, in OpenAI's shape; ``response``: the line's
    stored response as JSON text (put in as it is: an answer is never parsed here)."""
    if line.state in (Line.State.DONE, Line.State.FAILED):
        item: dict[str, Any] = {
            "id": line.result_id,
            "custom_id": line.custom_id,
            "response": {
                "status_code": line.status_code,
                "request_id": line.request_id,
                "body": _RESPONSE,
            },
            "error": None,
        }
    else:  # cancelled or expired: never answered
        item = {
            "id": line.result_id or "batch_req_" + secrets.token_hex(12),
            "custom_id": line.custom_id,
            "response": None,
            "error": _RESPONSE,
        }
    head, _, tail = orjson.dumps(item).partition(_RESPONSE_JSON)
    return head + (response or "null").encode() + tail + b"\n"


# Where a line's stored response goes in its output line: a string with a NUL, which no
# custom_id has (the validator refuses NUL) and nothing of ours does.
_RESPONSE = "\x00response"


_RESPONSE_JSON = orjson.dumps(_RESPONSE)
