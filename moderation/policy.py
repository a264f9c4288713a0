"""A tenant's moderation policy as the gateway holds it, and its validation.

The control plane stores the policy (``ModerationPolicy``) and publishes every tenant's as one
snapshot in Redis (``moderation.publishing``); each web process keeps a copy it refreshes when
a publish announces a change (``moderation.policy_view``), so a change applies everywhere within
two seconds and no request reads the database for it. ``PolicySpec`` is that snapshot's
entry, checked on decode.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import re2

from moderation.categories import CATEGORIES

Action = Literal["block", "flag", "log"]
PiiAction = Literal["off", "block", "mask", "log"]
OutputMode = Literal["hold", "async"]

ACTIONS: tuple[str, ...] = ("block", "flag", "log")
PII_ACTIONS: tuple[str, ...] = ("off", "block", "mask", "log")
OUTPUT_MODES: tuple[str, ...] = ("hold", "async")
SEVERITY = {"log": 1, "flag": 2, "block": 3}

MAX_TERMS = 1000
MAX_TERM_CHARS = 200
MAX_REGEXES = 50
MAX_REGEX_CHARS = 500
# re2 bounds a pattern's compiled program, so a tenant's pattern cannot eat a worker's memory
# either (the default is 8 MiB; this is plenty for any sensible rule).
REGEX_MAX_MEM = 1 << 20


class CategoryRule(msgspec.Struct, frozen=True):
    threshold: float
    action: Action


class PolicySpec(msgspec.Struct, frozen=True, kw_only=True):
    version: int = 0  # changes with every save: compiled matchers are cached under it
    check_input: bool = True
    check_output: bool = True
    action: Action = "block"  # for deny terms and regexes
    categories: dict[str, CategoryRule] = msgspec.field(default_factory=dict)  # the ones on
    deny_terms: list[str] = msgspec.field(default_factory=list)
    regexes: list[str] = msgspec.field(default_factory=list)
    pii_action: PiiAction = "off"
    classifier: bool = True  # the embedded classifier (harassment, from profanity)
    guard_model: str = ""  # a classification model served on a pool, by catalog name
    output_mode: OutputMode = "async"
    window_tokens: int = 64
    overlap_tokens: int = 16
    fail_open: bool = True
    budget_ms: int = 250
    store_text: bool = False  # events keep the text that fired (the tenant opted in)


class PolicyInvalid(ValueError):
    """A policy that cannot be saved; the message says which field and why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def regex_compile(pattern: str) -> re2._Regexp:
    options = re2.Options()
    options.max_mem = REGEX_MAX_MEM
    options.case_sensitive = False
    options.log_errors = False
    return re2.compile(pattern, options)


def min_step(window: int) -> int:
    """The least an output check's window moves on by: a quarter of the window, so each
    token is read by at most four checks (an overlap of window - 1 would read each window
    tokens over, on the shared event loop, at every token)."""
    return max(1, -(-window // 4))


def window_step(spec: PolicySpec) -> int:
    """How far each output check moves on: window - overlap, never under ``min_step`` (a
    policy saved before the floor existed gets it too)."""
    return max(spec.window_tokens - spec.overlap_tokens, min_step(spec.window_tokens))


def policy_check(spec: PolicySpec) -> None:
    """Raise ``PolicyInvalid`` for what cannot work: a regex re2 refuses (it has no
    backreferences or lookaround — which is what makes it linear), an unknown category, a
    threshold outside [0, 1], a window the overlap does not fit in."""
    for name, rule in spec.categories.items():
        if name not in CATEGORIES:
            raise PolicyInvalid("categories", f"unknown category {name!r}")
        if not 0.0 <= rule.threshold <= 1.0:
            raise PolicyInvalid("categories", f"the threshold of {name} must be within 0..1")
    if len(spec.deny_terms) > MAX_TERMS:
        raise PolicyInvalid("deny_terms", f"at most {MAX_TERMS} terms")
    for term in spec.deny_terms:
        if not term.strip():
            raise PolicyInvalid("deny_terms", "a term cannot be blank")
        if len(term) > MAX_TERM_CHARS:
            raise PolicyInvalid("deny_terms", f"a term has at most {MAX_TERM_CHARS} characters")
    if len(spec.regexes) > MAX_REGEXES:
        raise PolicyInvalid("regexes", f"at most {MAX_REGEXES} patterns")
    for pattern in spec.regexes:
        if not pattern or len(pattern) > MAX_REGEX_CHARS:
            raise PolicyInvalid("regexes", f"a pattern has 1 to {MAX_REGEX_CHARS} characters")
        try:
            regex_compile(pattern)
        except re2.error as exc:
            raise PolicyInvalid(
                "regexes", f"{pattern!r} is not a valid pattern: {_re2_reason(exc)}"
            ) from exc
    if not 4 <= spec.window_tokens <= 2048:
        raise PolicyInvalid("window_tokens", "the window is 4 to 2048 tokens")
    most = spec.window_tokens - min_step(spec.window_tokens)
    if not 0 <= spec.overlap_tokens <= most:
        raise PolicyInvalid(
            "overlap_tokens",
            f"the overlap is 0 to {most} tokens for a window of {spec.window_tokens} (each "
            "check moves on by at least a quarter of the window)",
        )
    if not 10 <= spec.budget_ms <= 10_000:
        raise PolicyInvalid("budget_ms", "the time budget is 10 to 10000 ms")


Snapshot = dict[int, PolicySpec]  # tenant id -> its policy (tenants without one are absent)
snapshot_decoder = msgspec.json.Decoder(Snapshot)


def _re2_reason(exc: re2.error) -> str:
    """RE2's message as text (google-re2 gives it as bytes: ``b'missing ): (a'``)."""
    reason = exc.args[0] if exc.args else exc
    if isinstance(reason, bytes):
        return reason.decode(errors="replace")
    return str(reason)
