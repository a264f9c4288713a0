"""The semantic lookup of the response cache (docs/cache.md): a single-turn request answered
from the tenant's stored answer to a text close enough in meaning, inside its partition.

A partition's vectors live in Redis (``s:<partition>``: answer hash -> float32 vector), with
a log of its changes (``sl:<partition>``). Each web process keeps a copy of the partitions
it has looked in, one matrix each, and brings it up to date with the changes since it last
read (``lua/cache/changes.lua``, one round trip), or whole when it fell behind the log. A
lookup is that round trip and a matrix-vector product (bench/cache.py), and every process
sees what any stored.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson
from django.conf import settings

from inference.gateway.cache import LOOKUP, Ticket, prefix
from inference.gateway.lua import Script

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
