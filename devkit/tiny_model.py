"""What the tiny chat model writes, known before a test runs (scripts/make_tiny_model.py
designs it): every chat answer is ``CYCLE`` over and over, one word a token, each after a
space; a completions prompt ending in a word of either cycle continues that cycle; ``" end"``
is followed by the end of the answer; ``RUNNER_UP`` is every token's second most likely
successor (in ``top_logprobs``, never in the text).

The lists are read from the generator itself; ``make`` regenerates the model whenever the
generator changes (it is the model's dependency), so the two agree."""

from __future__ import annotations

import ast
from pathlib import Path

_SOURCE = Path(__file__).resolve().parent.parent / "scripts" / "make_tiny_model.py"


def _constants() -> dict[str, object]:
    # The generator imports torch inside main() only; its constants are read without running
    # it (the web app's virtualenv has no torch).
    tree = ast.parse(_SOURCE.read_text())
    names = {"CYCLE", "OTHER_CYCLE", "END_WORD", "RUNNER_UP", "VERSION"}
    return {
        target.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id in names
    }


_C = _constants()
CYCLE: list[str] = _C["CYCLE"]  # type: ignore[assignment]
OTHER_CYCLE: list[str] = _C["OTHER_CYCLE"]  # type: ignore[assignment]
END_WORD: str = _C["END_WORD"]  # type: ignore[assignment]
RUNNER_UP: str = _C["RUNNER_UP"]  # type: ignore[assignment]  # every token's second choice
VERSION: str = _C["VERSION"]  # type: ignore[assignment]


def word_at(position: int, cycle: list[str] = CYCLE) -> str:
    """The word the model writes as token ``position`` (0-based) of a chat answer."""
    return cycle[position % len(cycle)]


def answer(tokens: int, *, start: int = 0, cycle: list[str] = CYCLE) -> str:
    """The text of ``tokens`` tokens of answer, from token ``start`` of the cycle on."""
    return "".join(" " + cycle[(start + i) % len(cycle)] for i in range(tokens))


def continuation(word: str, tokens: int) -> str:
    """What a completions prompt ending in ``" " + word`` (a word of either cycle) is
    continued with."""
    cycle = CYCLE if word in CYCLE else OTHER_CYCLE
    return answer(tokens, start=cycle.index(word) + 1, cycle=cycle)
