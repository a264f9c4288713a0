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

from inference.gateway.errors import invalid_request
from tenants.priority import DEFAULT_CLASS

PosInt = Annotated[StrictInt, Field(ge=1, le=10_000_000)]
# Prompts in one /v1/completions request. Every prompt x n is a sequence the engine runs at
# once, so a request is also bounded by its pool's capacity (see prepare._check_fits).
MAX_PROMPTS = 128
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
# chat_template_kwargs reach the engine's apply_chat_template: these would replace the
# template or the conversation itself (another tenant's model behaviour on a shared engine).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "tokenize",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer",
    }
)
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class StreamOptions(Strict):
    include_usage: StrictBool | None = None


class SamplingParams(Strict):
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
    # Narrows the tenant's own prefix-cache partition (inference.gateway.salt), never widens it.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None


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
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[
            list[Annotated[list[StrictInt], Field(min_length=1)]], Field(max_length=MAX_PROMPTS)
        ]
    )
    suffix: str | None = None
    echo: StrictBool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=1)] | None = None


# Inputs in one /v1/embeddings request: each is a sequence the engine embeds (prefill only),
# so a request is also bounded by its pool's capacity (prepare._check_fits).
MAX_EMBEDDING_INPUTS = 256


class EmbeddingRequest(Strict):
    """OpenAI's embeddings request (vLLM's pooling parameters left out: the engine's own)."""

    model: Annotated[str, Field(min_length=1, max_length=300)]
    input: Any  # checked by _check_embedding_input, for an error that says what it takes
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PosInt | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    truncate_prompt_tokens: PosInt | None = None
    # Narrows the tenant's own prefix-cache partition (inference.gateway.salt), never widens it.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None


DROPPED = ("store", "metadata", "service_tier", "stream_options", "max_completion_tokens")

ENDPOINTS: dict[str, type[Strict]] = {
    "chat.completions": ChatCompletionRequest,
    "completions": CompletionRequest,
    "embeddings": EmbeddingRequest,
}
# Endpoints whose answer is one JSON object the engine makes whole: nothing streams, nothing
# is generated (prompt tokens only), and a model of their task alone serves them.
PREFILL_ONLY = frozenset({"embeddings"})


@dataclass(slots=True)
class ParsedRequest:
    endpoint: str
    body: dict[str, Any]  # the client's JSON, validated
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None  # per sequence, as asked; None = until the context is full
    prompt_estimate: int  # tokens of all prompts, before the engine counts them
    prompts: int  # prompts in the request (completions may send a list)
    sequences: int  # what the engine runs at once: prompts x n
    prefix_hash: str  # for prefix-affine routing
    # The public endpoint the request came by, when it is not ``endpoint`` (a Responses API
    # request runs as a chat completion): the ledger's and the metrics' label.
    surface: str = ""
    # The priority class it runs in (``gateway.priority``; set by ``prepare``): its guard's
    # checks are admitted in its band on the guard pool too.
    priority: str = DEFAULT_CLASS

    @property
    def label(self) -> str:
        return self.surface or self.endpoint


# pydantic's names for the branches of a union, which are not part of a field's path.
UNION_LABELS = frozenset(
    {"str", "list[str]", "list[int]", "list[list[int]]", "list[any]", "dict[str,any]"}
    | {"literal['disabled']"}
)


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in UNION_LABELS:
            continue  # pydantic's union-branch labels
        else:
            out += f".{part}" if out else str(part)
    return out


def _prompt_shape(body: dict[str, Any], endpoint: str) -> tuple[bytes, int, int]:
    """(the prompt's text for the prefix hash, estimated prompt tokens, prompts) of a body.

    ~3 bytes a token for text; token ids count as themselves; chat adds 4 tokens of framing
    a message. The engine's own count corrects the estimate when the request ends."""
    if endpoint in ("completions", "embeddings"):
        prompt = body["prompt" if endpoint == "completions" else "input"]
        if isinstance(prompt, str):
            encoded = prompt.encode()
            return encoded, len(encoded) // 3 + 1, 1
        if prompt and isinstance(prompt[0], int):
            return orjson.dumps(prompt[:64]), len(prompt), 1
        if prompt and isinstance(prompt[0], list):
            return orjson.dumps(prompt[0][:64]), sum(len(p) for p in prompt), len(prompt)
        texts = [p.encode() for p in prompt]
        return b"\n".join(texts), sum(len(t) // 3 + 1 for t in texts), max(1, len(texts))
    parts: list[str] = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p.get("text") or "" for p in content if isinstance(p, dict))
    encoded = "\n".join(parts).encode()
    return encoded, len(encoded) // 3 + 4 * len(body["messages"]) + 1, 1


def _check_embedding_input(given: Any) -> None:
    """A string, or a list of strings, of token ids, or of lists of token ids: none empty,
    at most MAX_EMBEDDING_INPUTS of them."""

    def ids(value: Any) -> bool:
        return (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
        )

    if (isinstance(given, str) and given) or ids(given):  # one input, however long
        return
    if isinstance(given, list) and 0 < len(given) <= MAX_EMBEDDING_INPUTS:
        if all(isinstance(v, str) and v for v in given):
            return
        if all(ids(v) for v in given):
            return
    raise invalid_request(
        "'input' must be a non-empty string, or a list of non-empty strings, of token ids or "
        f"of lists of token ids, with at most {MAX_EMBEDDING_INPUTS} inputs.",
        param="input",
    )


def json_object(raw: bytes) -> dict[str, Any]:
    """A request's body as a JSON object, or the 400 that says it is not one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid_request(
            "We could not parse the JSON body of your request. Send valid JSON "
            "(see https://platform.openai.com/docs/api-reference)."
        ) from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


def validate(body: dict[str, Any], schema: type[BaseModel]) -> None:
    """``body`` against ``schema``, or the 400 naming the first field that does not fit,
    in OpenAI's words."""
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


def parse_request(raw: bytes, endpoint: str) -> ParsedRequest:
    body = json_object(raw)
    validate(body, ENDPOINTS[endpoint])

    if endpoint in PREFILL_ONLY:
        _check_embedding_input(body["input"])
        encoded, prompt_estimate, prompts = _prompt_shape(body, endpoint)
        return ParsedRequest(
            endpoint=endpoint,
            body=body,
            model=body["model"],
            stream=False,
            include_usage=False,
            max_tokens=None,
            prompt_estimate=prompt_estimate,
            prompts=prompts,
            sequences=prompts,
            prefix_hash=hashlib.blake2b(encoded[:512], digest_size=8).hexdigest(),
        )
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
    kwargs = body.get("chat_template_kwargs") or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise invalid_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the model's chat "
            "template and the conversation are the server's.",
            param=f"chat_template_kwargs.{reserved[0]}",
        )
    encoded, prompt_estimate, prompts = _prompt_shape(body, endpoint)
    return ParsedRequest(
        endpoint=endpoint,
        body=body,
        model=body["model"],
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        max_tokens=max_tokens,
        prompt_estimate=prompt_estimate,
        prompts=prompts,
        sequences=prompts * max(body.get("n") or 1, body.get("best_of") or 1),
        prefix_hash=hashlib.blake2b(encoded[:512], digest_size=8).hexdigest(),
    )


def upstream_body(
    parsed: ParsedRequest,
    *,
    served_name: str,
    max_tokens: int | None,
    cache_salt: str,
    whole: bool = False,
) -> bytes:
    """What the engine is sent: a stream with per-chunk usage, so that every request
    (streamed or not, finished or cut off) is metered with the engine's own counts; or, with
    ``whole`` (a batch line, which nobody watches arrive), one non-streamed answer, whose
    usage is the engine's counts too, at less work for the engine and for us. Always in the
    tenant's prefix-cache partition (``cache_salt``: inference.gateway.salt)."""
    body = {k: v for k, v in parsed.body.items() if k not in DROPPED}
    body["model"] = served_name
    body["cache_salt"] = cache_salt
    if parsed.endpoint in PREFILL_ONLY:  # answered whole, nothing to bound
        pass
    elif whole:
        body["stream"] = False
    else:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if parsed.endpoint not in PREFILL_ONLY:
        body.pop("max_tokens", None)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:  # deeper than orjson writes (255 levels), though it read it
        raise invalid_request(
            "The request body is nested too deeply (at most 255 levels of arrays and objects)."
        ) from None
