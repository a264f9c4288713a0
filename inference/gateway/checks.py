"""A validated request checked against what serves it: ``max_tokens`` against the model's
context and the tenant's cap, content parts against what the model accepts (images inline
only, from the allowed domains), and the engine's context error in OpenAI's words."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from inference.gateway.errors import ApiError, invalid_request
from inference.gateway.schema import ParsedRequest


def check_max_tokens(parsed: ParsedRequest, *, context_length: int, tenant_cap: int) -> int | None:
    """The max_tokens to send (per sequence): bounded by the model's context and by the
    tenant's limit on the tokens one request may produce, which counts every sequence the
    request runs (prompts x n)."""
    asked = parsed.max_tokens
    param = "max_completion_tokens" if "max_completion_tokens" in parsed.body else "max_tokens"
    if asked is not None and asked >= context_length:
        raise invalid_request(
            f"max_tokens is too large: {asked}. This model's context is {context_length} "
            "tokens, prompt included.",
            param=param,
        )
    if not tenant_cap:
        return asked
    seqs = parsed.sequences
    shape = f" x {seqs} sequences (prompts x n)" if seqs > 1 else ""
    if asked is not None and asked * seqs > tenant_cap:
        raise invalid_request(
            f"max_tokens is too large: {asked}{shape}. Your limit is {tenant_cap} tokens per "
            "request.",
            param=param,
        )
    if asked is None and tenant_cap < seqs:
        raise invalid_request(
            f"This request runs {seqs} sequences (prompts x n); your limit of {tenant_cap} "
            "tokens per request does not leave one token for each.",
            param="n",
        )
    return asked or tenant_cap // seqs


def check_content_parts(
    parsed: ParsedRequest, *, images: bool, audio: bool, url_domains: frozenset[str]
) -> None:
    """Only what the model takes reaches its engine. A text-only model refuses image, audio
    and file parts; images must come inline (``data:`` URLs) unless the operator allows
    their hosts (INFERPLANE_MEDIA_URL_DOMAINS): an engine that fetched any URL it was given
    would reach anything inside the GPU network."""
    if parsed.endpoint != "chat.completions":
        return
    for i, message in enumerate(parsed.body["messages"]):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type")
            where = f"messages[{i}].content[{j}]"
            if kind == "file":
                raise invalid_request(
                    "File content parts are not supported: send the text.",
                    param=f"{where}.type",
                    code="unsupported_content",
                )
            if (kind == "image_url" and not images) or (kind == "input_audio" and not audio):
                what = "images" if kind == "image_url" else "audio"
                raise invalid_request(
                    f"The model `{parsed.model}` does not take {what}: send text only.",
                    param=f"{where}.type",
                    code="unsupported_content",
                )
            if kind == "image_url":
                _check_media_url(part.get("image_url"), f"{where}.image_url.url", url_domains)


def _check_media_url(image: Any, param: str, domains: frozenset[str]) -> None:
    url = image.get("url") if isinstance(image, dict) else None
    if not isinstance(url, str) or not url:
        raise invalid_request("image_url.url must be a URL or a data: URL.", param=param)
    if url.startswith("data:"):
        return
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme == "https" and any(host == d or host.endswith("." + d) for d in domains):
        return
    allowed = f" or https URLs on {', '.join(sorted(domains))}" if domains else ""
    raise invalid_request(
        f"Images must be sent inline as data: URLs{allowed}.",
        param=param,
        code="unsupported_content",
    )


def context_error(message: str) -> ApiError:
    return ApiError(400, message, code="context_length_exceeded", param="messages")
