"""The Responses API (``/v1/responses``) in the words of chat completions: the request side.

A request's input items become the chat messages the engine reads, after the stored
conversation its ``previous_response_id`` names (the platform keeps it: ``conversations``;
the engines keep nothing). The engine's chat answer — whole, or chunk by chunk — becomes the
response object and the typed events of its stream. A Responses request is thus a chat
completion for everything between (limits, fair admission, routing, moderation, metering):
one path, on every generate engine, whatever its own Responses support.

What a chat completion cannot carry is refused with a clear error, never dropped in silence:
OpenAI's hosted tools (web search, file search, code interpreter, …) run on OpenAI's servers,
not on a tenant's engines; background mode, stored prompts, conversations objects and
truncation ``auto`` are not offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from inference.gateway.errors import ApiError, invalid_request
from inference.gateway.items import input_items
from inference.gateway.schema import PosInt, Strict, json_object, validate

# Fields of OpenAI's request that no chat completion can honour: each refused by name.
UNSUPPORTED = {
    "background": "Background responses are not supported: stream the response instead.",
    "conversation": "Conversation objects are not supported: chain responses with "
    "previous_response_id.",
    "prompt": "Stored prompt templates are not supported: send the input itself.",
    "max_tool_calls": "max_tool_calls is not supported: no hosted tools run here.",
    "top_logprobs": "top_logprobs is not supported on /v1/responses: use /v1/chat/completions.",
    "context_management": "context_management is not supported.",
}
HOSTED_TOOL = (
    "The hosted tool '{kind}' is not supported: Inferplane runs your models on your own "
    "engines, not OpenAI's tools. Give the model function tools and run them yourself."
)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class TextParam(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity: the model's own
    format: TextFormat | None = None


class ReasoningParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None


class ResponseRequest(Strict):
    """OpenAI's create-response request, as far as a chat completion can serve it, plus the
    vLLM sampling extras the other endpoints take (for outputs of a known length)."""

    model: Annotated[str, Field(min_length=1, max_length=300)]
    input: str | Annotated[list[Any], Field(min_length=1, max_length=4096)]
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    store: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: dict[str, StrictBool] | None = None  # include_obfuscation: nothing to hide
    max_output_tokens: PosInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    metadata: (
        Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None
    ) = None
    text: TextParam | None = None
    reasoning: ReasoningParam | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None
    # Accepted: each tenant's prefix cache is its own already (inference.gateway.salt).
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None
    include: Annotated[list[str], Field(max_length=0)] | None = None
    # vLLM's sampling extras, as on the other endpoints.
    seed: StrictInt | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    ignore_eos: StrictBool | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    # Narrows the tenant's own prefix-cache partition (inference.gateway.salt), never widens it.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None


PASSED = (
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "seed",
    "top_k",
    "min_p",
    "service_tier",
)
PASSED_EXTRA = ("min_tokens", "ignore_eos", "repetition_penalty", "stop", "cache_salt")


def read_request(raw: bytes) -> dict[str, Any]:
    """The client's body, validated; an ``ApiError`` naming the field otherwise."""
    body = json_object(raw)
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise invalid_request(why, param=name, code="unsupported_parameter")
    if body.get("truncation") == "auto":
        raise invalid_request(
            "truncation 'auto' is not supported: an input longer than the model's context "
            "is refused (truncation 'disabled').",
            param="truncation",
            code="unsupported_parameter",
        )
    if body.get("include"):
        raise invalid_request(
            "include is not supported: the response carries all it has.",
            param="include",
            code="unsupported_parameter",
        )
    validate(body, ResponseRequest)
    return body


@dataclass(slots=True)
class Translated:
    """A Responses request as the engine is sent it, and what is kept of it."""

    chat: dict[str, Any]  # the chat completions request
    input_items: list[dict[str, Any]]  # the request's input, each item with an id
    conversation: list[dict[str, Any]]  # the chat messages before the answer, no instructions


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise invalid_request(
                HOSTED_TOOL.format(kind=kind), param=f"tools[{i}].type", code="unsupported_tool"
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request(f"'tools[{i}].name' is required.", param=f"tools[{i}].name")
        function = {"name": name, "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise invalid_request(
                "tool_choice of type function needs its name.", param="tool_choice.name"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise invalid_request(
        HOSTED_TOOL.format(kind=kind)
        if isinstance(choice, dict)
        else "tool_choice must be auto, none, required or a function.",
        param="tool_choice",
        code="unsupported_tool" if isinstance(choice, dict) else None,
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid_request(
        "text.format.type must be text, json_object or json_schema.", param="text.format.type"
    )


def translate(body: dict[str, Any], history: list[dict[str, Any]], *, max_bytes: int) -> Translated:
    """The chat request for ``body`` after ``history`` (the stored conversation its
    ``previous_response_id`` names), and what is kept of it. The conversation, with this
    input, is bounded as a request body is (``max_bytes``): a chain cannot grow what each
    turn stores, reads and sends past what one request may carry."""
    items, messages = input_items(body["input"])
    conversation = [*history, *messages]
    chat: dict[str, Any] = {"model": body["model"]}
    instructions = body.get("instructions")
    chat["messages"] = (
        [{"role": "system", "content": instructions}, *conversation]
        if instructions
        else conversation
    )
    if body.get("stream"):
        chat["stream"] = True
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in (*PASSED, *PASSED_EXTRA):
        if body.get(name) is not None:
            chat[name] = body[name]
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    try:
        size = len(orjson.dumps(chat))
    except orjson.JSONEncodeError:  # deeper than orjson writes (255 levels), though it read it
        raise invalid_request(
            "The request body is nested too deeply (at most 255 levels of arrays and objects)."
        ) from None
    if size > max_bytes:
        raise invalid_request(
            f"The conversation is too large: with this input it is {size} bytes, past the "
            f"{max_bytes} one request may carry. Start a new conversation (without "
            "previous_response_id) or send less.",
            param="previous_response_id" if history else "input",
            code="request_too_large",
        )
    return Translated(chat=chat, input_items=items, conversation=conversation)


def renamed(error: ApiError) -> ApiError:
    """A chat completion's error in the Responses API's words (its parameters' names)."""
    names = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}
    if error.param in names:
        error.param = names[error.param]
    elif error.param is not None and error.param.startswith("messages"):
        error.param = "input"
    return error
