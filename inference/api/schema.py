"""Request validation against OpenAI's schema, plus vLLM's extra sampling parameters.

Unknown fields are refused (as OpenAI does) so that nothing unexpected reaches an engine:
vLLM parameters that let a caller change the server's behaviour for others (a custom chat
template, scheduling priority, KV transfer) are deliberately not on the list.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from inference.api.errors import ApiError, invalid_request

PosInt = Annotated[StrictInt, Field(ge=1, le=10_000_000)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None


class SamplingParams(_Strict):
    """Fields shared by chat and completions, OpenAI's and vLLM's (the allowlist)."""

    model: Annotated[str, Field(min_length=1, max_length=300)]
    max_tokens: PosInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: StrictInt | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    # Accepted for compatibility with OpenAI clients, not sent to the engine.
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extra sampling parameters.
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    length_penalty: float | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=64)] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    truncate_prompt_tokens: PosInt | None = None
    bad_words: Annotated[list[str], Field(max_length=256)] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingParams):
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    max_completion_tokens: PosInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    echo: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(SamplingParams):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    suffix: str | None = None
    echo: StrictBool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=1)] | None = None


DROPPED = ("store", "metadata", "service_tier", "stream_options", "max_completion_tokens")

ENDPOINTS: dict[str, type[SamplingParams]] = {
    "chat.completions": ChatCompletionRequest,
    "completions": CompletionRequest,
}


@dataclass(slots=True)
class ParsedRequest:
    endpoint: str
    body: dict[str, Any]  # the client's JSON, validated
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None  # as asked; None = until the context is full
    prompt_estimate: int  # tokens, before the engine counts them
    prefix_hash: str  # for prefix-affine routing


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "dict[str,any]"):
            continue  # pydantic's union-branch labels
        else:
            out += f".{part}" if out else str(part)
    return out


def _text_of(body: dict[str, Any], endpoint: str) -> str:
    """The prompt's text, for the token estimate and the prefix hash."""
    if endpoint == "completions":
        prompt = body["prompt"]
        return prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
    parts: list[str] = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p.get("text") or "" for p in content if isinstance(p, dict))
    return "\n".join(parts)


def parse_request(raw: bytes, endpoint: str) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid_request(
            "We could not parse the JSON body of your request. Send valid JSON "
            "(see https://platform.openai.com/docs/api-reference)."
        ) from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    schema = ENDPOINTS[endpoint]
    try:
        schema.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = _param(error["loc"])
        if error["type"] == "extra_forbidden":
            raise invalid_request(
                f"Unrecognized request argument supplied: {param}", param=param
            ) from None
        if error["type"] == "missing":
            raise invalid_request(f"Missing required parameter: '{param}'.", param=param) from None
        raise invalid_request(
            f"Invalid value for '{param}': {error['msg']}.", param=param
        ) from None

    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    if options and not stream:
        raise invalid_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if endpoint == "completions" and max_tokens is None:
        max_tokens = 16  # OpenAI's documented default for completions
    text = _text_of(body, endpoint)
    encoded = text.encode()
    messages = len(body.get("messages") or ())
    return ParsedRequest(
        endpoint=endpoint,
        body=body,
        model=body["model"],
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        max_tokens=max_tokens,
        # ~3 bytes a token, 4 tokens of chat framing a message; corrected from the engine's count.
        prompt_estimate=len(encoded) // 3 + 4 * messages + 1,
        prefix_hash=hashlib.blake2b(encoded[:512], digest_size=8).hexdigest(),
    )


def upstream_body(parsed: ParsedRequest, *, served_name: str, max_tokens: int | None) -> bytes:
    """What the engine is sent: always a stream with per-chunk usage, so that every request
    (streamed or not, finished or cut off) is metered with the engine's own counts."""
    body = {k: v for k, v in parsed.body.items() if k not in DROPPED}
    body["model"] = served_name
    body["stream"] = True
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    body.pop("max_tokens", None)
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return orjson.dumps(body)


def check_max_tokens(parsed: ParsedRequest, *, context_length: int, tenant_cap: int) -> int | None:
    """The max_tokens to send: bounded by the tenant's limit and the model's context."""
    asked = parsed.max_tokens
    param = "max_completion_tokens" if "max_completion_tokens" in parsed.body else "max_tokens"
    if asked is not None and asked >= context_length:
        raise invalid_request(
            f"max_tokens is too large: {asked}. This model's context is {context_length} "
            "tokens, prompt included.",
            param=param,
        )
    if tenant_cap:
        if asked is not None and asked > tenant_cap:
            raise invalid_request(
                f"max_tokens is too large: {asked}. Your limit is {tenant_cap} tokens per request.",
                param=param,
            )
        return asked or tenant_cap
    return asked


def context_error(message: str) -> ApiError:
    return ApiError(400, message, code="context_length_exceeded", param="messages")
