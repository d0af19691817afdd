"""Per-request sampling: each SamplingParams field changes the draw of its own row only."""

from __future__ import annotations

import math
import random

import mlx.core as mx
import pytest

from engine.llm.sampling import RowSampler, _weights, new_key, sample_batch
from engine.runtime.request import SamplingParams

# Probabilities 0.5 / 0.3 / 0.2 over the first three tokens, ~0 elsewhere.
BASE = [0.5, 0.3, 0.2] + [1e-9] * 13
LOGITS = mx.log(mx.array(BASE))


def _rows(
    n: int, seed0: int = 0, prompt: list[int] | None = None, **kw: object
) -> list[RowSampler]:
    params = SamplingParams(**kw)
    return [RowSampler(params, prompt or [], [], new_key(seed0 + i)) for i in range(n)]


def _draw(n: int = 400, logits: mx.array = LOGITS, **kw: object) -> set[int]:
    rows = _rows(n, **kw)
    return set(sample_batch(mx.broadcast_to(logits, (n, logits.size)), rows).tolist())


def test_temperature_zero_is_greedy() -> None:
    assert _draw(temperature=0.0, top_p=1.0) == {0}


def test_temperature_spreads_the_distribution() -> None:
    assert _draw(temperature=0.05, top_p=1.0) == {0}
    assert _draw(temperature=1.0, top_p=1.0) == {0, 1, 2}


def test_top_k_keeps_k_best() -> None:
    assert _draw(temperature=1.0, top_p=1.0, top_k=1) == {0}
    assert _draw(temperature=1.0, top_p=1.0, top_k=2) == {0, 1}


def test_top_p_keeps_the_nucleus() -> None:
    assert _draw(temperature=1.0, top_p=0.5) == {0}
    assert _draw(temperature=1.0, top_p=0.7) == {0, 1}


def test_min_p_drops_unlikely_tokens() -> None:
    # Keep tokens with p >= 0.5 * p_max = 0.25.
    assert _draw(temperature=1.0, top_p=1.0, min_p=0.5) == {0, 1}


def test_repetition_penalty_discourages_prompt_tokens() -> None:
    logits = mx.array([[2.0, 1.5, 0.0, -1.0]])
    plain = _rows(1, temperature=0.0, prompt=[0])
    penalised = _rows(1, temperature=0.0, prompt=[0], repetition_penalty=2.0)
    assert sample_batch(logits, plain).item() == 0
    assert sample_batch(logits, penalised).item() == 1


def test_presence_penalty_discourages_produced_tokens() -> None:
    logits = mx.array([[2.0, 1.5, 0.0, -1.0]])
    row = _rows(1, temperature=0.0, presence_penalty=1.0)[0]
    assert sample_batch(logits, [row]).item() == 0
    row.output_ids.append(0)
    assert sample_batch(logits, [row]).item() == 1
    # Prompt tokens do not count towards presence.
    fresh = _rows(1, temperature=0.0, presence_penalty=1.0, prompt=[0])
    assert sample_batch(logits, fresh).item() == 0


def test_logits_processors_see_history_and_shape_logits() -> None:
    seen: list[list[int]] = []

    def ban_zero(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(tokens.tolist())
        logits[:, 0] = -mx.inf
        return logits

    row = RowSampler(
        SamplingParams(temperature=0.0, logits_processors=[ban_zero]), [7], [3], new_key(0)
    )
    assert sample_batch(mx.array([[2.0, 1.0, 0.0]]), [row]).item() == 1
    assert seen == [[7, 3]]


def test_seed_reproducible_and_independent_of_batch() -> None:
    def seq(rows: list[RowSampler], index: int, steps: int = 20) -> list[int]:
        logits = mx.broadcast_to(mx.zeros((1, 64)), (len(rows), 64))
        return [sample_batch(logits, rows).tolist()[index] for _ in range(steps)]

    seeded = dict(temperature=1.0, top_p=1.0, seed=1234)
    alone = seq([RowSampler(SamplingParams(**seeded), [], [], new_key(1234))], 0)
    others = _rows(5, seed0=99, temperature=0.9, top_k=10)
    batched = seq(
        others[:2] + [RowSampler(SamplingParams(**seeded), [], [], new_key(1234))] + others[2:], 2
    )
    assert alone == batched
    different = seq([RowSampler(SamplingParams(**seeded), [], [], new_key(4321))], 0)
    assert different != alone


def test_rows_with_different_params_share_one_batch() -> None:
    greedy = _rows(1, temperature=0.0)
    topk1 = _rows(1, temperature=1.0, top_k=1, top_p=1.0)
    wide = _rows(200, temperature=1.0, top_p=1.0)
    logits = mx.broadcast_to(LOGITS, (202, LOGITS.size))
    tokens = sample_batch(logits, greedy + topk1 + wide).tolist()
    assert tokens[0] == 0 and tokens[1] == 0
    assert set(tokens[2:]) == {0, 1, 2}


@pytest.mark.parametrize("n", [1, 3])
def test_output_shape(n: int) -> None:
    rows = _rows(n)
    assert sample_batch(mx.zeros((n, 10)), rows).shape == (n,)


@pytest.mark.parametrize(
    ("history", "second", "expected"),
    [
        ([2], 2.5, 1),  # pending 0 is new: penalised once (4 / 1.5 - 0.3 < 2.5)
        ([0], 2.2, 0),  # pending 0 was produced before: still penalised once, not twice
    ],
)
def test_pending_token_counts_as_produced(history: list[int], second: float, expected: int) -> None:
    # A token drawn but not yet read back is penalised exactly as if it were recorded.
    logits = mx.array([[4.0, second, 1.8, 1.0, -1.0]])
    kw = dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.3)
    pending_row = _rows(1, prompt=[3], **kw)[0]
    pending_row.output_ids.extend(history)
    recorded_row = _rows(1, prompt=[3], **kw)[0]
    recorded_row.output_ids.extend(history + [0])
    seen: list[list[int]] = []

    def record(tokens: mx.array, x: mx.array) -> mx.array:
        seen.append(tokens.tolist())
        return x

    pending_row.params.logits_processors = [record]
    lazy_zero = mx.argmax(mx.array([5.0, 1.0]))[None]  # still unevaluated, like a draw
    with_pending = sample_batch(logits, [pending_row], [lazy_zero])
    recorded = sample_batch(logits, [recorded_row])
    assert with_pending.item() == recorded.item() == expected
    assert seen == [[3] + history + [0]]


def _reference_kept(x: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Plain-Python top-k, then top-p over the renormalised rest, then min-p."""
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if top_k:
        order = order[:top_k]
    weights = [math.exp(x[i] - x[order[0]]) for i in order]
    total = sum(weights)
    kept, before = [], 0.0
    for i, w in zip(order, weights, strict=True):
        if before < top_p and w >= min_p:
            kept.append(i)
        before += w / total
    return set(kept)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("spread", [0.05, 2.0, 8.0])  # near-flat to sharply peaked
# Past NUCLEUS_CANDIDATES tokens, near-flat rows look for the nucleus among all of them.
@pytest.mark.parametrize("V", [64, 3000])
def test_filters_keep_what_a_plain_reference_keeps(seed: int, spread: float, V: int) -> None:
    rng = random.Random(seed)
    cases = [
        (0, 0.9, 0.0),
        (5, 1.0, 0.0),
        (0, 1.0, 0.2),
        (12, 0.6, 0.05),
        (3, 0.3, 0.5),
        (0, 0.99, 0.0),
        (60, 0.95, 0.0),
    ]
    logits = [[rng.gauss(0.0, spread) for _ in range(V)] for _ in cases]
    rows = [
        RowSampler(SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=m), [], [], new_key(0))
        for k, p, m in cases
    ]
    x = mx.array(logits)
    kept = (_weights(x, rows) > 0).tolist()
    for row, (k, p, m), flags in zip(logits, cases, kept, strict=True):
        assert {i for i, f in enumerate(flags) if f} == _reference_kept(row, k, p, m)


def test_draw_frequencies_follow_the_probabilities() -> None:
    # Tokens 0-1 tie at 0.3 each, token 2 has 0.4; the rest are never drawn.
    probs = [0.3, 0.3, 0.4] + [0.0] * 5
    n = 3000
    rows = _rows(n, temperature=1.0, top_p=1.0)
    logits = mx.broadcast_to(mx.log(mx.array(probs)), (n, len(probs)))
    draws = sample_batch(logits, rows).tolist()
    share = [draws.count(t) / n for t in range(len(probs))]
    assert all(abs(s - p) < 0.04 for s, p in zip(share, probs, strict=True))


def test_a_one_token_vocabulary_samples_it() -> None:
    # MLX 0.32's shapeless compile crashes on a broadcast over an axis of length 1.
    rows = _rows(2, temperature=0.8, top_p=0.9)
    assert sample_batch(mx.array([[1.5], [-3.0]]), rows).tolist() == [0, 0]
