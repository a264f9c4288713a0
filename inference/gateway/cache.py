"""The response cache: a tenant's repeated request answered from its own stored answer,
without the engine (docs/cache.md).

A request is looked up by a hash of the tenant (from its key, never from anything the client
sends), the resolved model's version (an adapter's version; a base model's name, engine name
and creation), the endpoint and the whole request as sent, but for how it is carried (stream,
stream_options, and the priority class it asked for: service_tier). What cannot be answered
from a store is passed by (``bypass``, with why): a sampled request unless the caller opts in
(``X-Inferplane-Cache: sampled``; never with n > 1),
logprobs, images, audio or files, embeddings, the Responses API and batch lines. An answer is
kept only when it ended as asked (``stop``, ``tool_calls``, or ``length`` under a max_tokens the
caller set) and passed its moderation; a hit is replayed in the caller's shape through the
tenant's moderation as it is now, and billed as a hit (no engine tokens).

Entries live in Redis under the tenant's own hash tag (``ip:rc:{t:<tenant>}:``), at most
``INFERPLANE_RESPONSE_CACHE_MAX_ENTRIES`` and ``..._MAX_BYTES`` per tenant, the least recently
used evicted first, each for the tenant's TTL (``lua/cache/``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from django.conf import settings

from inference.gateway.auth import KeyInfo
from inference.gateway.lua import Batch, Script
from inference.gateway.schema import PREFILL_ONLY, ParsedRequest

if TYPE_CHECKING:  # the call carries its ticket (``Call.cache``)
    pass

LOOKUP = Script("cache", "lookup")
STORE = Script("cache", "store")
PURGE = Script("cache", "purge")

# How a request is carried, not what it asks: a streamed and a whole request share an answer,
# and so do requests in two priority classes (docs/priority.md).
CARRIAGE = ("stream", "stream_options", "service_tier")
# How an answer may end to be kept: as the model finished it (``length`` only when the
# caller set the limit it reached).
KEPT_ENDINGS = frozenset({"stop", "tool_calls"})


def prefix(tenant_id: int) -> str:
    return f"ip:rc:{{t:{tenant_id}}}:"


@dataclass(frozen=True, slots=True)
class Directives:
    """What the request's headers ask of the cache: ``Cache-Control: no-cache`` (do not
    answer from it; keep the new answer), ``no-store`` (neither), ``X-Inferplane-Cache:
    sampled`` (a sampled request may be answered from it, and kept)."""

    read: bool = True
    store: bool = True
    sampled: bool = False


def directives(cache_control: bytes | None, asked: bytes | None) -> Directives:
    given = {part.strip().lower() for part in (cache_control or b"").decode("latin-1").split(",")}
    store = "no-store" not in given
    return Directives(
        read=store and "no-cache" not in given,
        store=store,
        sampled=(asked or b"").strip().lower() == b"sampled",
    )


@dataclass(slots=True)
class Ticket:
    """One request's dealings with the cache: the outcome its headers say (``hit``,
    ``miss``, ``bypass`` and why), the stored answer on a hit, the answer to keep on a miss."""

    tenant_id: int
    digest: str
    ttl_ms: int
    outcome: str  # "miss" until a lookup hits; "bypass" when it cannot be cached
    reason: str = ""
    read: bool = True
    store: bool = True
    limit_asked: bool = False  # the caller set max_tokens: an answer it cut is as asked
    sequences: int = 1  # the choices a whole answer has
    entry: dict[str, Any] | None = None  # on a hit: {"choices": [...], "usage": {...}}
    kept: bytes = b""  # on a miss: the answer to store when the call settles well
    semantic: Semantic | None = None  # a single-turn request of a semantic cache

    @property
    def hit(self) -> bool:
        return self.outcome == "hit"

    @property
    def recording(self) -> bool:
        return self.outcome == "miss" and self.store

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-inferplane-cache", self.outcome.encode())]
        if self.reason:
            headers.append((b"x-inferplane-cache-reason", self.reason.encode()))
        if self.semantic is not None and self.semantic.similarity is not None:
            score = f"{self.semantic.similarity:.4f}".encode()
            headers.append((b"x-inferplane-cache-similarity", score))
        return headers


@dataclass(slots=True)
class Semantic:
    """What the semantic cache needs of a single-turn request: its partition (a hash of all
    of the request but its user text: model version, system prompt, tools, response format,
    sampling), that text, the tenant's threshold and embedding model; then its vector and the
    best similarity found."""

    partition: str
    text: str
    threshold: float
    model: str
    vector: bytes = b""  # float32, unit length: stored with the answer on a miss
    similarity: float | None = None


def _number(value: Any, default: float) -> float | None:
    """A sampling parameter as a number (the schema lets "0.2" through as one), or None."""
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _bypass_reason(parsed: ParsedRequest, asked: Directives, mode: str, policy: str) -> str:
    body = parsed.body
    if policy == "key-off":
        return "key"
    if mode == "batch":
        return "batch"
    if parsed.surface:  # the Responses API keeps conversations of its own
        return "endpoint"
    if not asked.store:
        return "no-store"
    if parsed.endpoint in PREFILL_ONLY:  # an embedding is the same each time: nothing sampled
        return ""
    chat = parsed.endpoint == "chat.completions"
    logprobs = body.get("logprobs")
    if (
        (logprobs if chat else logprobs is not None)
        or body.get("top_logprobs")
        or body.get("prompt_logprobs") is not None
    ):
        return "logprobs"
    for message in body.get("messages") or ():
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") not in ("text", "refusal")
            for part in content
        ):
            return "multimodal"
    # OpenAI's default temperature is 1: a request that says none is sampled.
    temperature, top_p = _number(body.get("temperature"), 1.0), _number(body.get("top_p"), 1.0)
    if temperature is None or top_p is None:
        return "sampled"
    sampled = temperature > 0 or top_p < 1
    if sampled and not asked.sampled:
        return "sampled"
    if sampled and max(body.get("n") or 1, body.get("best_of") or 1) > 1:
        return "sampled-n"
    return ""


def ticket(
    key: KeyInfo,
    parsed: ParsedRequest,
    *,
    version: str,
    max_tokens: int | None,
    asked: Directives | None,
    mode: str,
) -> Ticket | None:
    """The request's ticket, or None when its tenant has no cache (no header then).
    ``max_tokens``: the limit the engine is sent (the key's cap may lower the request's)."""
    policy, ttl_seconds, threshold, model = key.cache
    if policy not in ("exact", "semantic", "key-off"):
        return None
    asked = asked or Directives()
    found = Ticket(tenant_id=key.tenant_id, digest="", ttl_ms=ttl_seconds * 1000, outcome="miss")
    reason = _bypass_reason(parsed, asked, mode, policy)
    if reason:
        pass_by(found, reason)
        return found
    request = {k: v for k, v in parsed.body.items() if k not in CARRIAGE}
    request["max_tokens"] = max_tokens  # what the engine runs to, not what was asked
    try:
        body = orjson.dumps(request, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # nested deeper than orjson writes
        pass_by(found, "request")
        return found
    found.digest = hashlib.sha256(
        orjson.dumps([key.tenant_id, version, parsed.endpoint]) + b"\n" + body
    ).hexdigest()
    found.read, found.store = asked.read, asked.store
    found.limit_asked = any(
        parsed.body.get(name) is not None for name in ("max_tokens", "max_completion_tokens")
    )
    found.sequences = parsed.sequences
    if policy == "semantic" and model:
        found.semantic = _semantic(key.tenant_id, version, parsed, request, threshold, model)
    return found


def _semantic(
    tenant_id: int,
    version: str,
    parsed: ParsedRequest,
    request: dict[str, Any],
    threshold: float,
    model: str,
) -> Semantic | None:
    """A single-turn chat request (one user message, after at most one system or developer
    message; one choice) with its partition; None for any other."""
    messages = request.get("messages") or []
    if parsed.endpoint != "chat.completions" or parsed.sequences != 1 or not messages:
        return None
    *head, last = messages
    if last.get("role") != "user" or len(head) > 1:
        return None
    if head and head[0].get("role") not in ("system", "developer"):
        return None
    content = last.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            return None
        content = "".join(str(part.get("text") or "") for part in content)
    if not isinstance(content, str) or not content.strip():
        return None
    unsaid = {**request, "messages": [*head, {**last, "content": None}]}
    # The embedding model too: vectors of two models are not to be compared.
    partition = hashlib.sha256(
        orjson.dumps([tenant_id, version, parsed.endpoint, model])
        + b"\n"
        + orjson.dumps(unsaid, option=orjson.OPT_SORT_KEYS)
    ).hexdigest()[:32]
    return Semantic(partition=partition, text=content, threshold=threshold, model=model)


def pass_by(ticket: Ticket, reason: str) -> None:
    """The request does not use the cache, for ``reason`` (in its headers)."""
    ticket.outcome, ticket.reason = "bypass", reason
    ticket.read = ticket.store = False


async def lookup(ticket: Ticket) -> None:
    """A hit turns the ticket's outcome to ``hit`` with the stored answer. An entry older
    than the tenant's TTL now (it was lowered) is gone; one that does not read is a miss."""
    found = await LOOKUP(keys=[prefix(ticket.tenant_id)], args=[ticket.digest, ticket.ttl_ms])
    if not found:
        return
    try:
        entry = orjson.loads(found)
        valid = isinstance(entry, dict) and bool(entry.get("choices") or entry.get("data"))
    except orjson.JSONDecodeError:
        valid = False
    if valid:
        ticket.entry, ticket.outcome = entry, "hit"


def keep_embeddings(ticket: Ticket, answer: dict[str, Any]) -> None:
    """An embeddings answer of a miss, kept for the settle if it has every input's and fits."""
    data = answer["data"]
    if [item.get("index") for item in data] != list(range(ticket.sequences)):
        return
    kept = orjson.dumps({"data": data, "usage": answer.get("usage")})
    if len(kept) <= settings.INFERPLANE_RESPONSE_CACHE_MAX_ENTRY_BYTES:
        ticket.kept = kept


def keep(ticket: Ticket, answer: dict[str, Any]) -> None:
    """The complete answer of a miss, kept for the settle if it ended as asked and fits."""
    endings = KEPT_ENDINGS | ({"length"} if ticket.limit_asked else frozenset())
    choices = answer["choices"]
    if [choice.get("index") for choice in choices] != list(range(ticket.sequences)):
        return  # not every choice the request asked for
    if not all(choice.get("finish_reason") in endings for choice in choices):
        return
    data = orjson.dumps({"choices": answer["choices"], "usage": answer.get("usage")})
    if len(data) <= settings.INFERPLANE_RESPONSE_CACHE_MAX_ENTRY_BYTES:
        ticket.kept = data


def store_into(pipe: Batch, ticket: Ticket) -> None:
    """The kept answer, and on a semantic miss its text's vector in its partition."""
    semantic = ticket.semantic
    vector = [semantic.partition, semantic.vector] if semantic and semantic.vector else []
    pipe.script(
        STORE,
        [prefix(ticket.tenant_id)],
        [
            ticket.digest,
            ticket.kept,
            ticket.ttl_ms,
            settings.INFERPLANE_RESPONSE_CACHE_MAX_ENTRIES,
            settings.INFERPLANE_RESPONSE_CACHE_MAX_BYTES,
            *vector,
        ],
    )
