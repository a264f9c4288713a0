"""The cascade of checks a tenant's policy runs, cheapest first: its rules, the embedded
classifier, then a guard model on a pool (``POST /classify`` on a vLLM engine). One call
assesses a list of texts and says, per text, what fired and what the policy does about it.

The rules and the classifier run in the process (microseconds to a fraction of a
millisecond); the guard model is a request to an engine, bounded by the policy's time budget.
A guard that fails or runs out of time follows the policy: fail open (the text passes, the
failure is logged as an event) or fail closed (the text is blocked).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from redis.exceptions import RedisError

from contract import CatalogModel, CatalogPool
from fleet.models import Replica
from inference.engine_auth import engine_auth_headers
from inference.gateway.admission import DEFAULT_BAND, W_IN, Admission, CatalogMissing, admission
from inference.gateway.catalog import catalog_view
from inference.gateway.errors import ApiError
from inference.gateway.upstream import TRANSPORT_ERRORS, engine_session
from moderation import classifier
from moderation.categories import CATEGORIES
from moderation.policy import SEVERITY, PolicySpec
from moderation.rules import Rules

log = logging.getLogger(__name__)


class GuardFailed(Exception):
    """The guard model could not answer within the budget (no replica, an error, too slow)."""


@dataclass(slots=True)
class GuardUse:
    """What one request's checks cost the guard pool: the prompt tokens its engines counted
    (their own usage reports), for the ledger (``moderation.guard``, ``/v1/moderations``)."""

    tokens: int = 0
    pool: str = ""
    replica: str = ""
    weight: int = 1  # the tenant's fair-share weight, for the guard pool's admission
    # The band its checks are admitted in on the guard pool: the request's own (an
    # interactive request's check does not wait behind standard ones; a batch line's waits
    # behind every online request's).
    band: int = DEFAULT_BAND


# A guard call waits for its tenant's turn on the guard pool (the gateway's fair admission)
# at most this long; the policy's time budget usually ends the wait first.
ADMISSION_WAIT_SECONDS = 30.0
CHARS_PER_TOKEN = 4  # the admission's estimate of a text's tokens, before the engine counts
# Pieces (each at most half the model's context in characters) sent in one /classify call
# (at most a quarter of a replica's slots: a piece is a sequence, and a call that needs a
# whole replica would wait for every other tenant's to leave it): a huge
# text goes as several calls, each admitted in its tenant's turn, so another tenant's call
# waits behind one call's worth of it at most, never behind all of it.
PIECES_PER_CALL = 16
CALLS_AT_ONCE = 4  # a check's calls waiting or running at once


# A guard replica that failed (unreachable) is not sent to again at once:
# for this long this process sends to the pool's other ready replicas, and with none left
# applies the policy's fail-open/closed choice at once. A check that ran out of its own
# time budget marks nothing: the budget is the tenant's, and one tenant's short budget or
# huge text must not fail the guard for every other tenant. A replica that hangs is marked
# down by its health probe (``inference.tasks.replicas_probe_all``), for every process at once.
RETRY_AFTER_SECONDS = 5.0
_failed_at: dict[str, float] = {}  # replica URL -> when it failed


@dataclass(slots=True)
class Assessment:
    """One text's result: scores for all 13 categories (0 where no backend measures one),
    the categories over the policy's thresholds, the rules that fired, and the strongest
    action that applies (``None``: nothing fired)."""

    scores: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    measured: set[str] = field(default_factory=set)  # categories some backend scored
    categories: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)  # "deny_term", "regex", "pii:card_number"
    pii: list[tuple[str, int, int]] = field(default_factory=list)
    action: str | None = None
    failure: str = ""  # a backend that failed (fail open: logged; fail closed: blocked)

    def escalate(self, action: str) -> None:
        if self.action is None or SEVERITY[action] > SEVERITY[self.action]:
            self.action = action

    @property
    def flagged(self) -> bool:
        return self.action in ("block", "flag") or bool(self.categories)

    def result(self) -> dict[str, Any]:
        """OpenAI's moderation result (an entry of ``/v1/moderations``' ``results``)."""
        flagged_categories = set(self.categories)
        return {
            "flagged": self.flagged,
            "categories": {c: c in flagged_categories for c in CATEGORIES},
            "category_scores": {c: round(self.scores[c], 6) for c in CATEGORIES},
            "category_applied_input_types": {
                c: (["text"] if c in self.measured else []) for c in CATEGORIES
            },
        }

    def merge(self, other: Assessment) -> None:
        """Fold another window's result into this one (an answer's output, all windows)."""
        for name, value in other.scores.items():
            self.scores[name] = max(self.scores[name], value)
        self.measured |= other.measured
        self.categories += [c for c in other.categories if c not in self.categories]
        self.rules += [r for r in other.rules if r not in self.rules]
        if other.action is not None:
            self.escalate(other.action)
        self.failure = self.failure or other.failure


class Cascade:
    """A tenant's compiled policy: built once per policy version, shared by its requests."""

    def __init__(self, tenant_id: int, spec: PolicySpec) -> None:
        self.tenant_id = tenant_id
        self.spec = spec
        self.rules = Rules(spec)
        self.guard_model = spec.guard_model

    async def assess(
        self,
        texts: list[str],
        *,
        deadline: float | None = None,
        rules: bool = True,
        asked: bool = False,
        use: GuardUse | None = None,
    ) -> list[Assessment]:
        """Every backend of the policy; ``rules=False``: only the models (the classifier
        and the guard), for a caller that ran ``check_rules`` already. ``asked``: a caller
        that named the guard itself (``/v1/moderations``) gets it asked even when it failed
        a moment ago. ``use``: where the guard's tokens are added up, for the ledger."""
        if deadline is None:
            deadline = time.monotonic() + self.spec.budget_ms / 1000
        out = self.check_rules(texts) if rules else [Assessment() for _ in texts]
        return await self._models(texts, out, deadline, asked=asked, use=use)

    def check_rules(self, texts: list[str]) -> list[Assessment]:
        """The tenant's rules alone: tens of microseconds, no I/O (what the output guard
        runs before it releases the chunk that completes a window)."""
        spec = self.spec
        out = [Assessment() for _ in texts]
        for text, found in zip(texts, out, strict=True):
            hits = self.rules.check(text)
            if hits.terms:
                found.rules.append("deny_term")
                found.escalate(spec.action)
            if hits.regexes:
                found.rules.append("regex")
                found.escalate(spec.action)
            if hits.pii:
                found.pii = hits.pii
                found.rules += sorted({f"pii:{kind}" for kind, _, _ in hits.pii})
                # Masking is done to the text itself (``Guard.rewrite``); what is left is
                # recorded, as for log.
                found.escalate("block" if spec.pii_action == "block" else "log")
        return out

    async def _models(
        self,
        texts: list[str],
        out: list[Assessment],
        deadline: float,
        *,
        asked: bool,
        use: GuardUse | None,
    ) -> list[Assessment]:
        spec = self.spec
        scored: list[dict[str, float]] = [{} for _ in texts]
        if spec.classifier and any(texts):
            if classifier.loaded():
                scorer = classifier.classifier()
            else:
                # This process's first use (a web process starts loading it at boot, so
                # this is a worker's first moderated line): load it off the event loop,
                # however long that takes — a check is never skipped for want of it.
                scorer = await asyncio.to_thread(classifier.classifier)
            for i, score in enumerate(scorer.scores(texts)):
                scored[i][classifier.CATEGORY] = score
        if self.guard_model:
            try:
                guarded = await asyncio.wait_for(
                    self._guard(texts, asked=asked, use=use or GuardUse()), _left(deadline)
                )
            except (TimeoutError, GuardFailed) as exc:
                reason = str(exc) or "it did not answer within the time budget"
                self._failed(out, f"guard model {self.guard_model}: {reason}")
            else:
                for i, scores in enumerate(guarded):
                    for name, value in scores.items():
                        scored[i][name] = max(value, scored[i].get(name, 0.0))
        for found, scores in zip(out, scored, strict=True):
            for name, value in scores.items():
                found.scores[name] = value
                found.measured.add(name)
                rule = spec.categories.get(name)
                if rule is not None and value >= rule.threshold:
                    found.categories.append(name)
                    found.escalate(rule.action)
        return out

    def _failed(self, out: list[Assessment], reason: str) -> None:
        for found in out:
            found.failure = reason
            found.escalate("log" if self.spec.fail_open else "block")

    async def _guard(
        self, texts: list[str], *, asked: bool, use: GuardUse
    ) -> list[dict[str, float]]:
        """Scores from the guard model: a sequence classifier whose labels are OpenAI's 13
        categories in order, served on the model's online pool (vLLM ``/classify``).
        ``asked``: a replica that failed a moment ago is tried too.

        Each call (``PIECES_PER_CALL`` pieces at most) is admitted like any request to a
        pool: it waits for its tenant's turn in the pool's fair admission (a tenant's share,
        by the tokens it sends), runs on the replica admission picks, and frees its slot
        when it is answered; so one tenant sending the guard much, or huge texts, waits
        behind its own calls, not others'."""
        catalog = await catalog_view().get()
        model = catalog.models.get(self.guard_model)
        pool_name = (model.online_pool or "") if model is not None else ""
        pool = catalog.pools.get(pool_name)
        if model is None or pool is None or model.task != "classify":
            raise GuardFailed("no such classification model serving")
        if not model.open_to(self.tenant_id):  # made private after the policy was saved
            raise GuardFailed("not open to this organization")
        if not any(r.state == Replica.State.READY for r in pool.replicas.values()):
            raise GuardFailed("no replica ready")
        # A long text goes in pieces that fit the model's context (a text scores the most
        # any of its pieces does); pieces overlap so that nothing falls between two.
        # Half a character a token leaves room for most text; what is denser (a byte-level
        # tokenizer can spend a token a byte) is truncated by the engine, not refused.
        size = max(64, model.context_length // 2)
        pieces: list[str] = []
        owner: list[int] = []
        for i, text in enumerate(texts):
            for start in range(0, max(1, len(text)), size - size // 8):
                pieces.append(text[start : start + size])
                owner.append(i)
                if start + size >= len(text):
                    break
        # The calls queue in the tenant's own queue of the pool's admission, a few at once
        # (CALLS_AT_ONCE): a long text costs its own tenant turns, never another's, and its
        # calls do not flood the queue (a 256,000-character text is ~600 pieces).
        per_call = max(1, min(PIECES_PER_CALL, pool.max_inflight // 4))
        starts = range(0, len(pieces), per_call)
        room = asyncio.Semaphore(CALLS_AT_ONCE)

        async def call(first: int) -> list[list[float]]:
            async with room:
                part = pieces[first : first + per_call]
                return await self._classify_admitted(pool_name, pool, model, part, asked, use)

        calls = [asyncio.ensure_future(call(first)) for first in starts]
        try:
            answers = await asyncio.gather(*calls)
        finally:  # one failed (the check has failed): the others are not waited for
            for pending in calls:
                pending.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
        out: list[dict[str, float]] = [{} for _ in texts]
        for first, rows in zip(starts, answers, strict=True):
            for row, probs in enumerate(rows):
                scores = out[owner[first + row]]
                for name, p in zip(CATEGORIES, probs, strict=False):
                    scores[name] = max(float(p), scores.get(name, 0.0))
        return out

    async def _classify_admitted(
        self,
        pool_name: str,
        pool: CatalogPool,
        model: CatalogModel,
        pieces: list[str],
        asked: bool,
        use: GuardUse,
    ) -> list[list[float]]:
        """One ``/classify`` call of at most ``PIECES_PER_CALL`` pieces, admitted: each piece's
        probabilities, in order."""
        body = orjson.dumps(
            {
                "model": model.served_name,
                "input": pieces,
                "truncate_prompt_tokens": model.context_length,
            }
        )
        estimate = sum(len(piece) for piece in pieces) // CHARS_PER_TOKEN + 1
        rid = "guard-" + uuid.uuid4().hex
        gate = admission()
        try:
            chosen = await gate.admit(
                pool=pool_name,
                rid=rid,
                tenant=self.tenant_id,
                weight=use.weight,
                prompt_estimate=estimate,
                prefix="",
                wait_seconds=ADMISSION_WAIT_SECONDS,
                limit_keys=(),
                sequences=len(pieces),  # each piece is a sequence on the engine
                band=use.band,
            )
        except (ApiError, CatalogMissing) as exc:
            raise GuardFailed("no guard replica free in time") from exc
        except RedisError as exc:
            raise GuardFailed("its admission is unavailable (Redis)") from exc
        counted = 0
        try:
            replica = pool.replicas.get(chosen)
            failed_at = _failed_at.get(replica.url, -RETRY_AFTER_SECONDS) if replica else 0.0
            if (
                replica is not None
                and not asked
                and time.monotonic() - failed_at < RETRY_AFTER_SECONDS
            ):
                # It failed a moment ago (unreachable): another one, if the pool has one.
                try:
                    other = await gate.reroute(pool=pool_name, rid=rid, failed=chosen)
                except RedisError as exc:
                    raise GuardFailed("its admission is unavailable (Redis)") from exc
                replica = pool.replicas.get(other) if other and other != chosen else None
                if not other:
                    rid = ""  # its slot was released with the reroute
                if replica is None:
                    raise GuardFailed("its replicas failed a moment ago")
            if replica is None:
                raise GuardFailed("its replica left the pool")
            use.pool, use.replica = pool_name, replica.name
            try:
                try:
                    status, raw = await _classify(replica.url, body)
                except aiohttp.ServerDisconnectedError:
                    # Most likely a pooled keep-alive connection the engine had just closed:
                    # one fresh try before calling the replica failed (as the relay does).
                    status, raw = await _classify(replica.url, body)
            except TRANSPORT_ERRORS as exc:
                _failed_at[replica.url] = time.monotonic()
                raise GuardFailed(f"unreachable ({type(exc).__name__})") from exc
            # An error status fails this check alone: a text of one tenant's that the
            # engine cannot take must not take the replica away from the others (the health
            # probe says whether it is down).
            if status != 200:
                raise GuardFailed(f"the engine answered {status}")
            _failed_at.pop(replica.url, None)
            try:
                answer = orjson.loads(raw)
                counted = int((answer.get("usage") or {}).get("prompt_tokens") or 0)
                use.tokens += counted
                rows: list[list[float]] = [[] for _ in pieces]
                for row in answer["data"]:
                    rows[int(row["index"])] = [float(p) for p in row["probs"]]
                return rows
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as exc:
                raise GuardFailed("its answer was not a classification") from exc
        finally:
            if rid:  # its slot, and the difference between its estimate and its count
                adjustment = W_IN * (counted - estimate) if counted else 0
                await asyncio.shield(_complete(gate, pool_name, rid, adjustment))


async def _complete(gate: Admission, pool: str, rid: str, adjustment: int) -> None:
    """The call's slot back; a Redis that cannot take it now leaves it to the lease reaper
    (the check's result stands)."""
    try:
        await gate.complete(pool=pool, rid=rid, adjustment=adjustment)
    except RedisError:
        log.warning("could not free the guard slot of %s (the lease reaper will)", rid)


async def _classify(url: str, body: bytes) -> tuple[int, bytes]:
    async with engine_session().post(
        url.rstrip("/") + "/classify",
        data=body,
        headers={"content-type": "application/json", **engine_auth_headers()},
    ) as response:
        return response.status, await response.read()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
