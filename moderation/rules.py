"""The rules a tenant writes, run before any model: deny terms, regexes, checksummed PII.

- **Deny terms**: one Aho-Corasick automaton (``pyahocorasick``) over the casefolded text
  finds every term in one pass, however many there are; a hit counts only on word edges
  ("ass" does not fire inside "class").
- **Regexes**: compiled by RE2 (``google-re2``), which runs in time linear in the text and
  refuses the constructs (backreferences, lookaround) that make backtracking engines blow up,
  so no tenant's pattern can hang a worker.
- **PII**: a candidate counts only when its checksum holds (``python-stdnum``): card numbers
  by Luhn, IBANs by their country's format and mod-97. A long order number is not a card.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ahocorasick
import re2
from stdnum import iban, luhn

from moderation.policy import PolicySpec, regex_compile

# Candidates only; the checksum decides. 13-19 digits, spaces or dashes between groups.
_CARD = re2.compile(r"(?:\d[ -]?){12,18}\d")
_IBAN = re2.compile(r"[A-Za-z]{2}\d{2}(?: ?[A-Za-z0-9]){11,30}")


@dataclass(slots=True)
class RuleHits:
    terms: list[str] = field(default_factory=list)
    regexes: list[str] = field(default_factory=list)
    pii: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, start, end)

    def __bool__(self) -> bool:
        return bool(self.terms or self.regexes or self.pii)


def _word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def pii_spans(text: str) -> list[tuple[str, int, int]]:
    found: list[tuple[str, int, int]] = []
    for match in _CARD.finditer(text):
        start, end = match.span()
        if (start and text[start - 1].isdigit()) or (end < len(text) and text[end].isdigit()):
            continue  # part of a longer number
        digits = "".join(ch for ch in match.group() if ch.isdigit())
        if 13 <= len(digits) <= 19 and luhn.is_valid(digits):
            found.append(("card_number", start, end))
    for match in _IBAN.finditer(text):
        candidate = match.group().rstrip()
        # The regex is greedy: try the longest candidate, then shorter ones (an IBAN
        # followed by a word).
        for end in range(len(candidate), 14, -1):
            if iban.is_valid(candidate[:end]):
                found.append(("iban", match.start(), match.start() + end))
                break
    return found


def mask(text: str, spans: list[tuple[str, int, int]]) -> str:
    out, last = [], 0
    for kind, start, end in sorted(spans, key=lambda s: s[1]):
        if start < last:
            continue
        out += [text[last:start], f"[{kind}]"]
        last = end
    out.append(text[last:])
    return "".join(out)


class Rules:
    """One policy's rules, compiled once per policy version (``moderation.guard``)."""

    def __init__(self, spec: PolicySpec) -> None:
        self.automaton: ahocorasick.Automaton | None = None
        terms = {t.strip().casefold() for t in spec.deny_terms if t.strip()}
        if terms:
            self.automaton = ahocorasick.Automaton()
            for term in terms:
                self.automaton.add_word(term, term)
            self.automaton.make_automaton()
        self.regexes = [(p, regex_compile(p)) for p in spec.regexes]
        self.pii = spec.pii_action != "off"

    def check(self, text: str) -> RuleHits:
        hits = RuleHits()
        if self.automaton is not None:
            folded = text.casefold()
            for end, term in self.automaton.iter(folded):
                start = end - len(term) + 1
                before = folded[start - 1] if start else " "
                after = folded[end + 1] if end + 1 < len(folded) else " "
                edges_ok = (not _word_char(term[0]) or not _word_char(before)) and (
                    not _word_char(term[-1]) or not _word_char(after)
                )
                if edges_ok and term not in hits.terms:
                    hits.terms.append(term)
        for pattern, compiled in self.regexes:
            if compiled.search(text):
                hits.regexes.append(pattern)
        if self.pii:
            hits.pii = pii_spans(text)
        return hits
