"""The cascade's local checks: deny terms, regexes, checksummed PII, the embedded classifier,
and the validation that keeps a policy that cannot work from being saved."""

from __future__ import annotations

import pytest
from profanity_check import predict_prob

from moderation.classifier import classifier
from moderation.policy import PolicyInvalid, PolicySpec, policy_check
from moderation.rules import Rules, mask, pii_spans


def _rules(**fields: object) -> Rules:
    return Rules(PolicySpec(**fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("number", "is_card"),
    [
        ("4111 1111 1111 1111", True),  # Visa's test number: Luhn holds
        ("5500-0000-0000-0004", True),
        ("378282246310005", True),  # Amex, 15 digits
        ("4111 1111 1111 1112", False),  # one digit off: the checksum fails
        ("1234567890123456", False),  # an order number of card length
        ("12345678901234567890123", False),  # longer than any card
    ],
)
def test_a_card_number_counts_only_when_its_checksum_holds(number: str, is_card: bool) -> None:
    found = pii_spans(f"my number is {number}, thanks")
    assert [kind for kind, _, _ in found] == (["card_number"] if is_card else [])


@pytest.mark.parametrize(
    ("text", "is_iban"),
    [
        ("GB82 WEST 1234 5698 7654 32", True),
        ("pay DE89370400440532013000 today", True),
        ("GB82 WEST 1234 5698 7654 33", False),  # mod-97 fails
        ("XX82WEST12345698765432", False),  # no such country
    ],
)
def test_an_iban_counts_only_when_mod_97_holds(text: str, is_iban: bool) -> None:
    assert [k for k, _, _ in pii_spans(text)] == (["iban"] if is_iban else [])


def test_masking_replaces_exactly_the_numbers() -> None:
    text = "card 4111 1111 1111 1111 and iban GB82WEST12345698765432."
    assert mask(text, pii_spans(text)) == "card [card_number] and iban [iban]."


def test_deny_terms_match_whole_words_in_any_case() -> None:
    rules = _rules(deny_terms=["ass", "Forbidden Fruit"])
    assert rules.check("a first-class passage").terms == []
    assert rules.check("what an ASS.").terms == ["ass"]
    assert rules.check("the forbidden fruit, again").terms == ["forbidden fruit"]


def test_a_pathological_regex_runs_in_linear_time() -> None:
    # (a+)+$ takes exponential time in a backtracking engine on "aaaa…b"; RE2 does not care.
    rules = _rules(regexes=["(a+)+$", r"order-\d{4}"])
    assert rules.check("a" * 50_000 + "b").regexes == []
    assert rules.check("see ORDER-1234").regexes == [r"order-\d{4}"]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"regexes": ["(?<=a)b"]}, "regexes"),  # lookbehind: not linear, refused
        ({"regexes": ["(unclosed"]}, "regexes"),
        ({"deny_terms": ["  "]}, "deny_terms"),
        ({"window_tokens": 16, "overlap_tokens": 16}, "overlap_tokens"),
        ({"window_tokens": 2}, "window_tokens"),
        ({"budget_ms": 0}, "budget_ms"),
    ],
)
def test_a_policy_that_cannot_work_is_refused_with_its_reason(
    fields: dict[str, object], field: str
) -> None:
    with pytest.raises(PolicyInvalid) as refused:
        policy_check(PolicySpec(**fields))  # type: ignore[arg-type]
    assert refused.value.field == field
    assert refused.value.message


def test_the_embedded_classifier_scores_as_the_library_does() -> None:
    texts = ["you are a stupid idiot", "the sea is calm today", "shut the fuck up", ""]
    ours = classifier().scores(texts)
    theirs = predict_prob(texts)
    assert ours == pytest.approx(list(theirs), abs=1e-9)
    assert ours[0] > 0.9 > 0.1 > ours[1]
