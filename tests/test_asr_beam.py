"""Beam search over next-token log-probabilities (engine/stages/asr_beam.py), on a
scripted model whose next distribution depends on the whole transcript so far."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.stages.asr_beam import Hypothesis, beam_search

EOT, A, B, C = 0, 1, 2, 3
# The next token's probabilities after each transcript; unlisted ones go to the end.
SCRIPT: dict[tuple[int, ...], dict[int, float]] = {
    (): {A: 0.5, B: 0.4, C: 0.1},
    # Greedy takes "a" (0.5), whose best ending is weak; "b" ends almost surely.
    (A,): {EOT: 0.3, C: 0.25, B: 0.25, A: 0.2},
    (B,): {EOT: 0.9, C: 0.1},
    (A, C): {EOT: 0.5, C: 0.5},
    (A, B): {EOT: 0.5, C: 0.5},
    (A, A): {EOT: 1.0},
    (B, C): {EOT: 1.0},
}


def _logprobs(history: tuple[int, ...]) -> np.ndarray:
    probs = SCRIPT.get(history, {EOT: 1.0})
    row = np.full(4, -np.inf)
    for token, p in probs.items():
        row[token] = math.log(p)
    return row


class ScriptedModel:
    """`advance` as the decoder runs it: rows are indices into the last call's rows."""

    def __init__(self) -> None:
        self.histories: list[tuple[int, ...]] = [()]
        self.calls = 0

    def first(self) -> np.ndarray:
        return _logprobs(())

    def advance(self, rows: list[int], tokens: list[int]) -> np.ndarray:
        self.calls += 1
        self.histories = [self.histories[r] + (t,) for r, t in zip(rows, tokens, strict=True)]
        return np.stack([_logprobs(h) for h in self.histories])


def search(beam_size: int, cap: int = 10, start: list[int] | None = None) -> Hypothesis:
    model = ScriptedModel()
    return beam_search(
        model.first(),
        model.advance,
        beam_size=beam_size,
        eot=EOT,
        cap=cap,
        start=start or [],
        stop_on_loop=False,
    )


def test_one_beam_is_greedy() -> None:
    best = search(1)
    assert best.tokens == [A] and best.broken is None
    assert best.logprobs == [math.log(0.5)] and best.end_logprob == pytest.approx(math.log(0.3))


def test_beams_find_the_likelier_transcript_greedy_misses() -> None:
    best = search(2)
    assert best.tokens == [B]
    assert best.total == pytest.approx(math.log(0.4 * 0.9))


def test_transcripts_are_ranked_by_log_probability_per_token() -> None:
    # "a c" ends at 0.5 * 0.25 * 0.5, below "b" (0.36) in total and per token.
    best = search(4)
    assert best.tokens == [B]
    assert best.score == pytest.approx(math.log(0.36) / 1)


def test_a_forced_start_is_kept_and_counts_toward_the_cap() -> None:
    best = search(2, cap=2, start=[C])
    # Every transcript reaches the cap one token after the forced one.
    assert best.tokens[0] == C and len(best.tokens) == 2 and best.broken == "token cap"


def test_a_transcript_that_ended_beats_one_cut_at_the_cap() -> None:
    best = search(3, cap=2)
    assert best.broken is None and best.tokens == [B]


def test_beam_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="beam_size"):
        search(0)
