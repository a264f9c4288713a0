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
import re
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from django.conf import settings

from inference.gateway.auth import KeyInfo
from inference.gateway.lua import Batch, Script
from inference.gateway.schema import PREFILL_ONLY, ParsedRequest

if TYPE_CHECKING:  # the call carries its ticket (``Call.cache``)
    from inference.gateway.call import Call

LOOKUP = Script("cache", "lookup")
STORE = Script("cache", "store")
PURGE = Script("cache", "purge")

# How a request is carried, not what it asks: a streamed and a whole request share an answer,
# and so do requests in two priority classes (docs/priority.md).
CARRIAGE = ("stream", "stream_options", "service_tier")
# How an answer may end to be kept: as the model finished it (``length`` only when the
# caller set the limit it reached).
KEPT_ENDINGS = frozenset({"stop", "tool_calls"})
# A replayed stream's text, a word to an event: about a token each, as the engine streamed
# it (the moderation's windows count a stream's events as tokens at least).
WORDS_PER_CHUNK = 1


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


# --- the semantic lookup ------------------------------------------------------------------
#
# A partition's vectors live in Redis (``s:<partition>``: answer hash -> float32 vector), with
# a log of its changes (``sl:<partition>``). Each web process keeps a copy of the partitions
# it has looked in, one matrix each, and brings it up to date with the changes since it last
# read (``lua/cache/changes.lua``, one round trip), or whole when it fell behind the log. A
# lookup is that round trip and a matrix-vector product (bench/cache.py), and every process
# sees what any stored.

CHANGES = Script("cache", "changes")


def _np() -> Any:
    """numpy, imported when the semantic cache first needs it: a process that never looks up
    by meaning (a Celery worker, which forks its pool) never loads it, nor its BLAS threads
    (threads and fork do not mix)."""
    import numpy

    return numpy


class _Mirror:
    """One partition's vectors as rows of a matrix with room to grow; a row leaves by taking
    the last row's place."""

    __slots__ = ("digests", "dims", "matrix", "position", "rows")

    def __init__(self, dims: int, position: int) -> None:
        self.dims = dims
        self.position = position
        self.rows: dict[str, int] = {}
        self.digests: list[str] = []
        self.matrix = _np().empty((16, dims), dtype=_np().float32)

    @classmethod
    def whole(cls, dims: int, position: int, pairs: list[bytes]) -> _Mirror:
        """A partition from its (hash, vector, hash, vector, ...), in one array."""
        mirror = cls(dims, position)
        usable = [
            (pairs[i].decode(), pairs[i + 1])
            for i in range(0, len(pairs), 2)
            if len(pairs[i + 1]) == 4 * dims
        ]
        if usable:
            mirror.digests = [digest for digest, _ in usable]
            mirror.rows = {digest: row for row, digest in enumerate(mirror.digests)}
            rows = _np().frombuffer(b"".join(v for _, v in usable), dtype=_np().float32)
            mirror.matrix = _np().empty((max(16, 2 * len(usable)), dims), dtype=_np().float32)
            mirror.matrix[: len(usable)] = rows.reshape(-1, dims)
        return mirror

    def add(self, digest: str, vector: bytes) -> None:
        if len(vector) != 4 * self.dims:  # another model's: never compared
            return
        row = self.rows.get(digest)
        if row is None:
            row = self.rows[digest] = len(self.digests)
            self.digests.append(digest)
            if row == len(self.matrix):
                grown = _np().empty((2 * row, self.dims), dtype=_np().float32)
                grown[:row] = self.matrix
                self.matrix = grown
        self.matrix[row] = _np().frombuffer(vector, dtype=_np().float32)

    def remove(self, digest: str) -> None:
        row = self.rows.pop(digest, None)
        if row is None:
            return
        last = len(self.digests) - 1
        moved = self.digests.pop()
        if row != last:
            self.matrix[row] = self.matrix[last]
            self.digests[row] = moved
            self.rows[moved] = row

    def best(self, vector: Any) -> tuple[str, float] | None:
        if not self.digests:
            return None
        scores = self.matrix[: len(self.digests)] @ vector
        row = int(_np().argmax(scores))
        return self.digests[row], float(scores[row])


_mirrors: OrderedDict[tuple[int, str], _Mirror] = OrderedDict()
_mirror_rows = 0


def unit_vector(values: Any) -> Any:
    """A vector (a list of floats, or an array) as float32 of unit length."""
    np = _np()
    vector = np.asarray(values, dtype=np.float32)
    if not np.isfinite(vector).all():
        raise ValueError("the embedding is not finite")
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


async def _mirror(tenant_id: int, partition: str, dims: int) -> _Mirror:
    """This process's copy of a partition, brought up to date (one round trip)."""
    global _mirror_rows
    where = (tenant_id, partition)
    mirror = _mirrors.get(where)
    if mirror is not None and mirror.dims != dims:
        mirror = None  # the tenant changed embedding models: start again
    kind, position, *changes = await CHANGES(
        keys=[prefix(tenant_id)], args=[partition, mirror.position if mirror else -1]
    )
    current = _mirrors.get(where)
    if current is not mirror and current is not None and current.dims == dims:
        mirror = current  # another lookup brought it up to date meanwhile
    elif kind == b"full" or mirror is None:
        mirror = _Mirror.whole(dims, int(position), changes[0])
        _mirror_rows += len(mirror.digests) - (len(current.digests) if current else 0)
        _mirrors[where] = mirror
    else:
        # What this copy counted, and what it replaces (a copy of other dimensions; or none,
        # when the copy was dropped for room meanwhile).
        before = len(mirror.digests) if current is mirror else 0
        if current is not None and current is not mirror:
            before += len(current.digests)
        entries, vectors = changes
        added = iter(vectors)
        for entry in entries:
            if entry[:1] == b"+":
                vector = next(added)
                if vector is not None:  # stored and gone since: a "-" follows
                    mirror.add(entry[1:].decode(), vector)
            else:
                mirror.remove(entry[1:].decode())
        mirror.position = int(position)
        _mirrors[where] = mirror
        _mirror_rows += len(mirror.digests) - before
    _mirrors.move_to_end(where)
    while _mirror_rows > settings.INFERPLANE_RESPONSE_CACHE_MIRROR_ROWS and len(_mirrors) > 1:
        _, dropped = _mirrors.popitem(last=False)
        _mirror_rows -= len(dropped.digests)
    return mirror


async def lookup_similar(ticket: Ticket, vector: Any) -> None:
    """The stored answer whose text is most similar to this request's, inside its partition,
    if the similarity reaches the tenant's threshold: the ticket turns to a hit."""
    semantic = ticket.semantic
    if semantic is None:
        return
    semantic.vector = vector.astype(_np().float32).tobytes()
    if not ticket.read:  # Cache-Control: no-cache: the vector is kept with the answer only
        return
    mirror = await _mirror(ticket.tenant_id, semantic.partition, int(vector.shape[0]))
    found = mirror.best(vector)
    if found is None:
        return
    digest, semantic.similarity = found
    if not semantic.similarity >= semantic.threshold:  # NaN never reaches it
        return
    stored = await LOOKUP(keys=[prefix(ticket.tenant_id)], args=[digest, ticket.ttl_ms])
    if stored:
        try:
            entry = orjson.loads(stored)
        except orjson.JSONDecodeError:
            return
        if isinstance(entry, dict) and entry.get("choices"):
            ticket.entry, ticket.outcome = entry, "hit"


_WORDS = re.compile(r"\s*\S+\s*")


def _pieces(text: str) -> list[str]:
    """A text in the pieces a stream would have brought it in."""
    words = _WORDS.findall(text) or [text]
    return ["".join(words[i : i + WORDS_PER_CHUNK]) for i in range(0, len(words), WORDS_PER_CHUNK)]


def replay_chunks(
    entry: dict[str, Any], *, chat: bool, rid: str, created: int, model: str, null_usage: bool
) -> list[dict[str, Any]]:
    """A stored answer as the chunks of a stream (the final usage chunk is the caller's)."""
    head: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
    }
    tail = {"usage": None} if null_usage else {}
    chunks: list[dict[str, Any]] = []

    def chunk(index: int, finish: str | None = None, **part: Any) -> None:
        choice: dict[str, Any] = {"index": index, **part, "logprobs": None, "finish_reason": finish}
        chunks.append({**head, "choices": [choice], **tail})

    for stored in entry["choices"]:
        index = stored.get("index", 0)
        ending = {"stop_reason": stored["stop_reason"]} if "stop_reason" in stored else {}
        if not chat:
            for piece in _pieces(stored.get("text") or ""):
                chunk(index, text=piece)
            chunk(index, stored.get("finish_reason"), text="", **ending)
            continue
        message = stored.get("message") or {}
        chunk(index, delta={"role": "assistant", "content": ""})
        for name in ("reasoning_content", "reasoning", "content", "refusal"):
            for piece in _pieces(message.get(name) or "") if message.get(name) else ():
                chunk(index, delta={name: piece})
        for position, call in enumerate(message.get("tool_calls") or ()):
            chunk(index, delta={"tool_calls": [{"index": position, **call}]})
        chunk(index, stored.get("finish_reason"), delta={}, **ending)
    return chunks


class Replay:
    """The relay's stand-in on a hit: the stored answer, as the chunks a stream of it would
    have had, with nothing sent to an engine (no replica was taken)."""

    answer: dict[str, Any] | None = None  # never the engine's whole answer

    def __init__(self, call: Call, entry: dict[str, Any]) -> None:
        self.call = call
        self.entry = entry

    async def start(self) -> None:
        call = self.call
        call.streaming()
        call.counts.ttft_ms = int((time.perf_counter() - call.t0) * 1000)

    def usage(self) -> dict[str, Any]:
        """What the answer's usage said when the engine made it (billed: nothing)."""
        return dict(self.entry.get("usage") or self.call.usage())

    async def __aiter__(self) -> AsyncGenerator[list[dict[str, Any]]]:
        call = self.call
        parsed = call.parsed
        chat = parsed.endpoint == "chat.completions"
        chunks = replay_chunks(
            self.entry,
            chat=chat,
            rid=call.rid,
            created=int(call.started_at.timestamp()),
            model=parsed.model,
            null_usage=parsed.include_usage and chat,
        )
        if parsed.include_usage:
            chunks.append({**chunks[0], "choices": [], "usage": self.usage()})
        yield chunks
        call.end()  # delivered: a client gone before this is a cut-off

    async def drain(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def stop(self) -> None:
        return None
