"""Clause splitting: punctuation rules, abbreviations, numbers, caps, and streaming."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.stages.clauses import ClauseSplitter, split_clauses


def test_sentences_split_at_terminators() -> None:
    text = "The capital of France is Paris. It is lovely! Have you been there? Yes."
    assert split_clauses(text) == [
        "The capital of France is Paris.",
        "It is lovely!",
        "Have you been there?",
        "Yes.",
    ]


def test_titles_and_initials_do_not_end_a_sentence() -> None:
    text = "Dr. Smith met Mr. J. K. Rowling today. They talked."
    assert split_clauses(text) == ["Dr. Smith met Mr. J. K. Rowling today.", "They talked."]


def test_dotted_abbreviations_stay_inside_a_clause() -> None:
    text = "Bring fruit, e.g. apples or pears, to the U.S. office on time. Thanks."
    assert split_clauses(text, min_chars=100, first_min_chars=100) == [
        "Bring fruit, e.g. apples or pears, to the U.S. office on time.",
        "Thanks.",
    ]


def test_abbreviation_ends_a_sentence_before_a_capital() -> None:
    text = "I moved to the U.S. Then I got a job."
    assert split_clauses(text) == ["I moved to the U.S.", "Then I got a job."]


def test_numbers_are_never_split() -> None:
    text = "Pi is about 3.14 and a thousand is 1,000 exactly. Version 2.0.1 is out."
    assert split_clauses(text, min_chars=10, first_min_chars=10) == [
        "Pi is about 3.14 and a thousand is 1,000 exactly.",
        "Version 2.0.1 is out.",
    ]


def test_ellipsis_splits_only_before_a_capital() -> None:
    assert split_clauses("Well... maybe not. Hmm… Okay then.") == [
        "Well... maybe not.",
        "Hmm…",
        "Okay then.",
    ]


def test_pronoun_i_may_end_a_sentence() -> None:
    assert split_clauses("So do I. See you.") == ["So do I.", "See you."]


def test_first_clause_may_end_at_an_early_comma() -> None:
    text = "Sure thing, my friend, the capital of France is Paris, a city on the Seine."
    assert split_clauses(text, first_min_chars=10, min_chars=48) == [
        "Sure thing,",
        "my friend, the capital of France is Paris, a city on the Seine.",
    ]


def test_short_comma_clause_is_not_split() -> None:
    assert split_clauses("Yes, it is.") == ["Yes, it is."]


def test_closing_quotes_stay_with_their_sentence() -> None:
    assert split_clauses('He said "hello." Then he left.') == [
        'He said "hello."',
        "Then he left.",
    ]


def test_newline_ends_a_clause() -> None:
    assert split_clauses("First line\nSecond line") == ["First line", "Second line"]


def test_very_long_clause_is_cut_at_a_space_before_the_cap() -> None:
    text = " ".join(["word"] * 100)
    clauses = split_clauses(text, max_chars=40, first_min_chars=10, min_chars=10)
    assert all(len(c) <= 40 for c in clauses)
    assert " ".join(clauses) == text


def test_long_clause_prefers_the_last_comma_before_the_cap() -> None:
    text = "alpha beta gamma, delta epsilon zeta eta theta iota kappa lambda mu"
    clauses = split_clauses(text, max_chars=40, first_min_chars=40, min_chars=40)
    assert clauses[0] == "alpha beta gamma,"


def test_first_clause_is_cut_at_a_space_past_its_cap() -> None:
    text = "The tallest mountain in the world is Mount Everest in Nepal. It is high."
    assert split_clauses(text, first_max_chars=40) == [
        "The tallest mountain in the world is",
        "Mount Everest in Nepal.",
        "It is high.",
    ]


def test_streaming_waits_for_lookahead() -> None:
    splitter = ClauseSplitter()
    assert splitter.push("It costs 3.") == []  # could still become 3.14
    assert splitter.push("14 dollars.") == []
    assert splitter.push(" And") == ["It costs 3.14 dollars."]
    assert splitter.flush() == ["And"]


def test_flush_of_empty_splitter_is_empty() -> None:
    assert ClauseSplitter().flush() == []


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError):
        ClauseSplitter(first_min_chars=0)
    with pytest.raises(ValueError):
        ClauseSplitter(min_chars=200, max_chars=100)


_ALPHABET = "abc XYZ .,!?;:…\"'0123456789\nDr.etc"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=_ALPHABET, max_size=300), st.lists(st.integers(1, 7), max_size=80))
def test_streaming_matches_whole_text(text: str, sizes: list[int]) -> None:
    limits = {"first_min_chars": 5, "first_max_chars": 20, "min_chars": 12, "max_chars": 40}
    splitter = ClauseSplitter(**limits)
    streamed: list[str] = []
    pos = 0
    for size in sizes:
        streamed += splitter.push(text[pos : pos + size])
        pos += size
    streamed += splitter.push(text[pos:])
    streamed += splitter.flush()
    assert streamed == split_clauses(text, **limits)
    assert all(c == c.strip() and c for c in streamed)
    assert "".join(streamed).replace(" ", "") == "".join(text.split())
