"""Moderation on the request path: each web process's copy of the policies, and the guard a
moderated request runs through (``inference.gateway.seams``: an input check beside the upstream
request, an output filter over its stream). Registered with the gateway when the app is
ready (``moderation.apps``), so SSE, WebSocket, non-streamed answers and batch lines are all
moderated the same way, and a tenant without a policy pays nothing.

**Input.** Every text the engine reads (``engine_read``: messages with their names, tool
calls and reasoning, the tools' definitions, prompts, ``suffix``) goes through the tenant's
rules before the request waits for a replica (``input_rules``: a prompt they block is
answered at once, however full the pool, and costs the engine nothing), then its models
while the engine does its prefill (``check_input``); the first token is released only once
both passed. Token-id prompts carry no text to read: the
policy's fail-open/closed choice decides them.

**Output.** Every text a choice shows the client (``visible_texts``: its answer, refusal,
reasoning, tool calls and ``top_logprobs`` alternatives) is checked on a sliding window:
every ``window - overlap`` tokens (at least a quarter of the window), the last ``window``
tokens, so a phrase of up to ``overlap`` tokens that straddles two windows is still seen
whole. ``async`` mode releases tokens at once and cuts within one window
of the violation; ``hold`` mode releases text only once a window that contains it has passed
(and keeps the overlap back until the next one has), so no unchecked text reaches the client.

The policies' copy is ``moderation.policy_view``, the texts read ``moderation.texts``, what
a check leaves behind (events, metrics, the guard models' records) ``moderation.records``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from contract import UsageRecord
from inference.gateway import metering, metrics
from inference.gateway.auth import KeyInfo
from inference.gateway.schema import ParsedRequest
from inference.gateway.seams import Chunk, GuardBuilder, InputCheck, Screened
from moderation.cascade import Assessment, Cascade, GuardUse
from moderation.policy import SEVERITY, PolicySpec, window_step
from moderation.policy_view import policy_view
from moderation.records import guard_cost, guard_record, moderation_checked, record_event
from moderation.texts import input_texts, mask_body, visible_texts
from tenants.priority import band

log = logging.getLogger(__name__)

MODEL_NAME = "inferplane-moderation"


@dataclass(slots=True)
class _Choice:
    # What the choice showed as it came: (the engine's completion tokens up to the end of
    # this delta, the delta's texts by stream). A delta can carry several tokens (the engine
    # merges steps when its stream is read slower than it generates), so tokens are the
    # engine's count.
    parts: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    tokens: int = 0
    checked: int = 0  # tokens checked so far
    ruled: int = 0  # async mode: the least the count can have been where the rules last read
    read: int = 0  # parts the rules have read (a window, or a read inside a batch)
    held: deque[tuple[int, Chunk]] = field(default_factory=deque)  # (tokens up to it, chunk)

    def window(self, size: int, overlap: int) -> str:
        """The texts of the last ``size`` tokens, and always of every token since the last
        check and the ``overlap`` before it (a delta that straddles the edge, whole), each
        stream's joined, the streams one after another. A check can come more than a step
        after the last one (a delta the engine merged from many steps): its window then
        reaches back to the overlap, so no token goes out unread and a word across the
        last check's edge is read whole."""
        start = min(self.tokens - size, self.checked - overlap)
        i = len(self.parts)
        while i > 0 and self.parts[i - 1][0] > start:
            i -= 1
        return self._joined(i)

    def unread(self, overlap: int) -> str:
        """The texts since the rules last read, and the ``overlap`` parts before (each is a
        token at least: a phrase across the edge is read whole)."""
        return self._joined(max(0, self.read - overlap))

    def _joined(self, first: int) -> str:
        streams: dict[str, list[str]] = {}
        for _, texts in self.parts[first:]:
            for stream, text in texts.items():
                streams.setdefault(stream, []).append(text)
        return "\n".join("".join(texts) for texts in streams.values())


class Guarded:
    """One request's guard: its input check and its output filter. What they found is shown
    to the client, when the policy flags, as OpenAI shows moderated completions: a
    ``moderation`` object (``input`` and ``output`` results) on the non-streamed answer, or on
    a chunk of its own at the end of a stream, before the usage chunk."""

    def __init__(
        self,
        cascade: Cascade,
        *,
        key: KeyInfo,
        rid: str,
        parsed: ParsedRequest,
        tokens: Mapping[int, int],
    ):
        self.cascade = cascade
        self.tokens = tokens
        self.spec: PolicySpec = cascade.spec
        self.key = key
        self.rid = rid
        self.chat = parsed.endpoint == "chat.completions"
        self.model = parsed.model
        self.head: Chunk | None = None  # the first chunk: its id and creation time
        self.choices: dict[int, _Choice] = {}
        self.tail: list[Chunk] = []  # what follows the text (the usage chunk)
        self.input_found: Assessment | None = None
        self.input_text: str | None = None  # the input the models check beside the prefill
        self.output_found: Assessment | None = None
        self.show = False  # a flag fired: the answer carries the moderation object
        self.output_action: str | None = None  # the strongest output event recorded
        self.checks: list[asyncio.Task[tuple[int, str, Assessment]]] = []
        # what the guard's engines counted for it; its checks in the request's band
        self.use = GuardUse(weight=key.weight, band=band(parsed.priority))
        self.started_at = datetime.now(UTC)
        spec = self.spec
        self.hold = spec.output_mode == "hold"
        self.window = spec.window_tokens
        self.overlap = spec.overlap_tokens
        self.step = window_step(spec)

    @property
    def rewrites(self) -> bool:
        """Whether ``rewrite`` changes what the engine is sent (PII masked)."""
        return self.spec.pii_action == "mask"

    @property
    def input_check(self) -> InputCheck | None:
        """The models' check beside the prefill, when the rules let the input through and
        the policy has models (``input_rules`` ran first)."""
        if self.input_text is None or not (self.spec.classifier or self.spec.guard_model):
            return None
        return self.check_input

    # before the request waits for admission (seams.RequestGuard.input_rules)
    async def input_rules(self, parsed: ParsedRequest, key: KeyInfo) -> str | None:
        """The rules (deny terms, regexes, PII to block), tens of microseconds: an input
        they block is never sent to the engine, so it costs nothing and the engine counts
        nothing. Token-id prompts carry no text: the fail-open/closed choice decides them."""
        if not self.spec.check_input:
            return None
        texts = input_texts(parsed)
        if texts is None:
            found = Assessment(failure="token-id prompts carry no text to check")
            found.escalate("log" if self.spec.fail_open else "block")
            return await self._input_verdict(found, "", key)
        checked = time.perf_counter()
        found = self.cascade.check_rules(texts)[0]
        if found.action == "block" or not (self.spec.classifier or self.spec.guard_model):
            moderation_checked("input", found, time.perf_counter() - checked)
            return await self._input_verdict(found, texts[0], key)
        self.input_found, self.input_text = found, texts[0]  # the models add theirs
        return None

    # the input check beside the prefill (seams.InputCheck)
    async def check_input(self, parsed: ParsedRequest, key: KeyInfo) -> str | None:
        text = self.input_text or ""
        checked = time.perf_counter()
        found = self.input_found or Assessment()
        found.merge((await self.cascade.assess([text], rules=False, use=self.use))[0])
        moderation_checked("input", found, time.perf_counter() - checked)
        return await self._input_verdict(found, text, key)

    async def _input_verdict(self, found: Assessment, text: str, key: KeyInfo) -> str | None:
        self.input_found = found
        if found.action is None:
            return None
        await record_event(
            self.cascade, key=key, rid=self.rid, where="input", found=found, text=text
        )
        if found.action == "block":
            if found.failure and not found.categories and not found.rules:
                return "The request could not be checked by moderation and was not processed."
            return _refusal("Your request", found)
        if found.action == "flag":
            self.show = True
        return None

    def rewrite(self, upstream: bytes) -> bytes:
        """PII masked in the prompt before the engine sees it (``pii_action: mask``)."""
        if self.spec.pii_action != "mask":
            return upstream
        return mask_body(upstream, lambda text: self.cascade.rules.check(text).pii)

    # the output filter (seams.OutputFilter)
    async def screen(self, batch: list[Chunk]) -> Screened:
        release: list[Chunk] = []
        check = self.spec.check_output
        cut = await self._collect(release, wait=False)  # a window checked meanwhile
        if cut is not None:
            return Screened(release, cut)
        # The engine's counts (continuous usage stats) are the relay's as of the batch's
        # last chunk: a choice's earlier chunks in the batch end before it, one token each
        # at least (so their counts here are never below their true ones).
        shown = [
            (chunk, visible_texts(chunk["choices"][0], chat=self.chat))
            if check and chunk.get("choices")
            else (chunk, {})
            for chunk in batch
        ]
        after: Counter[int] = Counter(
            int(chunk["choices"][0].get("index") or 0) for chunk, texts in shown if texts
        )
        # Each choice's count at its chunks in this batch, from below: one token a chunk
        # past the count it had before the batch (exact: the last batch's end).
        least: dict[int, int] = {}
        for chunk, texts in shown:
            choices = chunk.get("choices")
            if not choices:
                self.tail.append(chunk)  # the usage chunk: the stream's last, kept for end()
                continue
            if self.head is None:
                self.head = chunk
            if not check:
                release.append(chunk)
                continue
            c = choices[0]
            index = int(c.get("index") or 0)
            state = self.choices.get(index)
            if state is None:
                state = self.choices[index] = _Choice()
            if texts:
                least[index] = least.get(index, state.tokens) + 1
                after[index] -= 1
                state.tokens = max(state.tokens + 1, self.tokens.get(index, 0) - after[index])
                state.parts.append((state.tokens, texts))
            finished = bool(c.get("finish_reason"))
            held = self.hold and bool(texts or state.held)
            if held:
                state.held.append((state.tokens, chunk))
            # A window ends only where the count is the engine's own: at the choice's last
            # chunk in the batch (earlier ones' counts are bounds from above: a window ended
            # there would release held tokens by a count they have not reached).
            exact = after[index] == 0 or finished
            if exact and (
                state.tokens - state.checked >= self.step
                or (finished and state.tokens > state.checked)
            ):
                # Async mode: the chunk that completes a window goes out only once it passed.
                cut = await self._window(index, state, final=finished, release=release)
                if cut is not None:
                    return Screened(release, cut)
            elif finished and self.hold:
                self._release(state, state.tokens, release)
            elif (
                not self.hold
                and texts
                and state.tokens - max(state.checked, state.ruled) >= self.step
            ):
                # Async mode, inside a batch (a reader behind the engine takes many chunks
                # at once): the rules read what came since the last window before this
                # chunk goes out, so the cut still comes within a window of a deny term.
                # The count here is a bound from above, so no window ends (``checked``
                # stays): the next one reads all of this again with its edge. Measured from
                # the least the count was at the last read, chunks that carry many tokens
                # are each read (the bounds are far apart), one-token chunks every step;
                # each read takes only what is new since the last, with its edge (however
                # long the batch, its text is read about once).
                state.ruled = least[index]
                text = state.unread(self.overlap)
                state.read = len(state.parts)
                cut = await self._verdict(index, text, self.cascade.check_rules([text])[0])
                if cut is None:
                    cut = await self._collect(release, wait=False)
                if cut is not None:
                    return Screened(release, cut)
            if not held:
                release.append(chunk)
        return Screened(release, await self._collect(release, wait=False))

    async def end(self) -> Screened:
        release: list[Chunk] = []
        for index, state in self.choices.items():
            if state.tokens > state.checked:
                cut = await self._window(index, state, final=True, release=release)
                if cut is not None:
                    return Screened(release, cut)
            self._release(state, state.tokens, release)
        cut = await self._collect(release, wait=True)
        if cut is not None:
            return Screened(release, cut)
        if self.show:
            release.append(self._moderation_chunk())
        release += self.tail
        self.tail = []
        return Screened(release)

    def _moderation_chunk(self) -> Chunk:
        head = self.head or {}
        return {
            "id": head.get("id", f"cmpl-{self.rid}"),
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": head.get("created", int(time.time())),
            "model": self.model,
            "choices": [],
            "moderation": {
                "input": _results(self.input_found),
                "output": _results(self.output_found),
            },
        }

    def _release(self, state: _Choice, upto: int, release: list[Chunk]) -> None:
        while state.held and state.held[0][0] <= upto:
            release.append(state.held.popleft()[1])

    async def _window(
        self, index: int, state: _Choice, *, final: bool, release: list[Chunk]
    ) -> str | None:
        """Check choice ``index``'s last window; in hold mode, release what it cleared."""
        end = state.tokens
        text = state.window(self.window, self.overlap)
        state.checked = end
        state.read = len(state.parts)
        if self.hold:
            checked = time.perf_counter()
            found = (await self.cascade.assess([text], use=self.use))[0]
            moderation_checked("output", found, time.perf_counter() - checked)
            cut = await self._verdict(index, text, found)
            if cut is None:
                self._release(state, end if final else end - self.overlap, release)
            return cut
        # Async mode: the rules (tens of microseconds) before the chunk that completes the
        # window goes out, so a deny term or regex is never released past its window. The
        # models run in a task: the batch goes out first and their CPU (the classifier, a
        # fraction of a millisecond) or wait (a guard model) fills the gateway's wait for the
        # engine's next batch; their verdict is taken before anything more is released, and
        # the previous window's must be in before the next starts.
        cut = await self._verdict(index, text, self.cascade.check_rules([text])[0])
        if cut is None:
            cut = await self._collect(release, wait=True)
        if cut is None and (self.spec.classifier or self.spec.guard_model):
            self.checks.append(asyncio.create_task(self._checked(index, text)))
        return cut

    async def _checked(self, index: int, text: str) -> tuple[int, str, Assessment]:
        checked = time.perf_counter()
        found = (await self.cascade.assess([text], rules=False, use=self.use))[0]
        moderation_checked("output", found, time.perf_counter() - checked)
        return index, text, found

    async def _collect(self, release: list[Chunk], *, wait: bool) -> str | None:
        while self.checks and (wait or self.checks[0].done()):
            index, text, found = await self.checks.pop(0)
            cut = await self._verdict(index, text, found)
            if cut is not None:
                self.cancel()
                return cut
        return None

    async def _verdict(self, index: int, text: str, found: Assessment) -> str | None:
        if self.output_found is None:
            self.output_found = Assessment()
        self.output_found.merge(found)
        action = found.action
        if action is None:
            return None
        if self.output_action is None or SEVERITY[action] > SEVERITY[self.output_action]:
            self.output_action = action
            await record_event(
                self.cascade, key=self.key, rid=self.rid, where="output", found=found, text=text
            )
        if action == "flag":
            self.show = True
        if action == "block":
            metrics.MODERATION_CUTS.labels(self.spec.output_mode).inc()
            return _refusal(f"Choice {index}'s output", found)
        return None

    def cancel(self) -> None:
        for task in self.checks:
            task.cancel()
        self.checks = []

    async def spent(self, *, mode: str) -> tuple[int, int]:
        """The request has ended: checks still running are stopped (nothing is left for
        them to hold back), and what the guard's engines counted for it is returned as
        (tokens, their cost in micro-dollars), for the request's limits and budgets."""
        pending = [task for task in self.checks if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        tokens = self.use.tokens
        if not tokens:
            return 0, 0
        try:
            cost = await guard_cost(
                self.key, self.cascade.guard_model, tokens, batch=mode == "batch"
            )
        except Exception:  # the catalog is unreadable: the ledger still prices the record
            log.warning("could not price the guard's tokens of %s", self.rid, exc_info=True)
            cost = 0
        return tokens, cost

    async def settle(
        self, *, mode: str, ledger: Callable[[UsageRecord], None] | None = None
    ) -> None:
        """The guard model's work for this request, as its engines counted it, is a record
        of its own on the guard model (priced by the price book, on the invoice): the tenant
        whose text was checked pays for the checking, as for the answer (``spent`` ran
        first). ``ledger``: where the request's own record went (a batch line's goes with
        its line, billed once the line is stored), else the spool."""
        if not self.use.tokens:
            return
        record = guard_record(
            rid=f"{self.rid}:guard",
            key=self.key,
            model=self.cascade.guard_model,
            use=self.use,
            mode=mode,
            started_at=self.started_at,
        )
        if ledger is not None:
            ledger(record)
        else:
            await metering.store(record)


def _results(found: Assessment | None) -> dict[str, Any]:
    """One side of OpenAI's ``ChatCompletionModeration``: the results, or why there are none."""
    if found is not None and found.failure and not found.measured and not found.rules:
        return {"type": "error", "code": "moderation_unavailable", "message": found.failure}
    results = (
        []
        if found is None
        else [found.result() | {"type": "moderation_result", "model": MODEL_NAME}]
    )
    return {"type": "moderation_results", "model": MODEL_NAME, "results": results}


def _refusal(what: str, found: Assessment) -> str:
    reasons = [*found.categories, *found.rules] or ["moderation unavailable"]
    return f"{what} was blocked by this organization's content policy ({', '.join(reasons)})."


async def guard_source(key: KeyInfo) -> GuardBuilder | None:
    """The gateway's guard source (``seams.guard_source_set``): a builder of guards for the
    key's tenant, or None when it does not moderate (then nothing here runs for it)."""
    cascade = await policy_view().cascade(key.tenant_id)
    if cascade is None or not (cascade.spec.check_input or cascade.spec.check_output):
        return None

    def build(rid: str, parsed: ParsedRequest, tokens: Mapping[int, int]) -> Guarded:
        return Guarded(cascade, key=key, rid=rid, parsed=parsed, tokens=tokens)

    return build
