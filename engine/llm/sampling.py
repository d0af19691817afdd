"""Per-request sampling inside a shared decode batch.

Each row of the batch's logits is shaped by its own request's `SamplingParams`:
logits processors and penalties row by row (only rows that use them), then temperature,
top-k, top-p and min-p as one per-row cut on the token weights, then an inverse-CDF draw
whose uniform comes from the request's own random key. A seeded request therefore draws
the same tokens whichever other requests share its batch. A batch pays only for the
filters its rows use; only top-p sorts the vocabulary, and only its plausible part.

A pipelined decode samples step N+1 before the host has read step N's tokens, so a row
may come with a `pending` token: drawn, still lazy, and not yet in its `output_ids`.
Penalties and logits processors count it as produced, which keeps their view of the
history exactly what a synchronous loop would have shown them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import mlx.core as mx

from engine.runtime.request import SamplingParams

__all__ = ["RowSampler", "new_key", "sample_batch"]


def new_key(seed: int | None) -> mx.array:
    """A request's random key: from its seed, or fresh entropy when it has none."""
    return mx.random.key(seed if seed is not None else random.getrandbits(63))


@dataclass
class RowSampler:
    """What one batch row needs to be sampled: its params, history and random key."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    key: mx.array
    error: Exception | None = None  # set when a logits processor of this row raised


Pending = Sequence[mx.array | None]


def sample_batch(
    logits: mx.array, rows: Sequence[RowSampler], pending: Pending | None = None
) -> mx.array:
    """Sample one token per row of `logits` (B, V); advances each sampled row's key.

    `pending[i]`, when given and not None, is a (1,) token row i produced that its
    `output_ids` does not hold yet.
    """
    if logits.dtype != mx.float32:
        logits = logits.astype(mx.float32)
    logits = _process_rows(logits, rows, pending or [None] * len(rows))
    greedy = mx.argmax(logits, axis=-1)
    if all(r.params.greedy for r in rows):
        return greedy
    sampled = _sample_filtered(logits, rows)
    if not any(r.params.greedy for r in rows):
        return sampled
    is_greedy = mx.array([r.params.greedy for r in rows])
    return mx.where(is_greedy, greedy, sampled)


def _process_rows(logits: mx.array, rows: Sequence[RowSampler], pending: Pending) -> mx.array:
    if not any(_needs_row_processing(r.params) for r in rows):
        return logits
    out = []
    for i, row in enumerate(rows):
        x = logits[i : i + 1]
        if _needs_row_processing(row.params):
            try:
                x = _process_row(x, row, pending[i])
            except Exception as exc:  # a user callable: fail its row, not the batch
                row.error = exc
                x = logits[i : i + 1]
        out.append(x)
    return mx.concatenate(out, axis=0)


def _needs_row_processing(p: SamplingParams) -> bool:
    return bool(p.logits_processors) or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0


def _process_row(x: mx.array, row: RowSampler, pending: mx.array | None) -> mx.array:
    p = row.params
    shape = x.shape
    for fn in p.logits_processors or []:
        x = fn(_with_pending(row.prompt_ids + row.output_ids, pending), x)
        if not isinstance(x, mx.array) or x.shape != shape:
            raise ValueError(f"logits processor {fn!r} must return an array of shape {shape}")
    if p.repetition_penalty != 1.0:
        # As in vLLM: every token seen in prompt or output is penalised.
        seen = _with_pending(sorted(set(row.prompt_ids) | set(row.output_ids)), pending)
        if seen.size:
            # A pending token already seen appears twice; both writes carry one value.
            vals = x[:, seen]
            x[:, seen] = mx.where(
                vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty
            )
    if p.presence_penalty != 0.0 and (row.output_ids or pending is not None):
        # As in the OpenAI API: only tokens the model itself produced.
        produced = _with_pending(sorted(set(row.output_ids)), pending)
        x[:, produced] = x[:, produced] - p.presence_penalty
    return x


def _with_pending(ids: list[int], pending: mx.array | None) -> mx.array:
    known = mx.array(ids, dtype=mx.int32)
    if pending is None:
        return known
    return mx.concatenate([known, pending.astype(mx.int32)])


def _sample_filtered(logits: mx.array, rows: Sequence[RowSampler]) -> mx.array:
    temps = mx.array([r.params.temperature or 1.0 for r in rows])[:, None]
    weights = _weights(logits / temps, rows)
    # Inverse-CDF draw in vocabulary order: one uniform per row, and every token owns an
    # interval as wide as its weight, so tokens of equal weight are equally likely.
    cum = mx.cumsum(weights, axis=-1)
    total = cum[:, -1:]
    u = mx.stack([_uniform(r) for r in rows])[:, None] * total
    u = mx.minimum(u, total * (1.0 - 2.0**-20))  # a rounded-up product must not reach the end
    return mx.sum(cum <= u, axis=-1).astype(mx.uint32)


_NO_FILTER = SamplingParams(temperature=1.0, top_p=1.0)
# Where top-p looks for its nucleus first. Sorting SmolLM2's whole vocabulary (49,152)
# took 4.5 ms on a 2-core x86 CPU, finding the best 1,024 with `topk` and sorting those
# 0.6 ms; a nucleus of top_p 0.9 holds more tokens only in near-flat distributions.
NUCLEUS_CANDIDATES = 1024


def _filters(p: SamplingParams) -> bool:
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)


def _weights(scaled: mx.array, rows: Sequence[RowSampler]) -> mx.array:
    """Each token's probability relative to its row's best token (B, V), and 0 for the
    tokens that top-k, top-p and min-p filter out.

    Filters cut by weight, so tokens tied at a cut are kept or dropped together. Only
    top-p sorts, and only the tokens that could be in its nucleus.
    """
    weights = _relative(scaled)
    if not any(_filters(r.params) for r in rows):
        return weights
    V = scaled.shape[-1]
    params = [r.params if _filters(r.params) else _NO_FILTER for r in rows]
    cut = mx.array([p.min_p for p in params])[:, None]  # min-p: weight >= min_p
    ks = [min(p.top_k, V) for p in params]
    cut_k = mx.zeros_like(cut)
    if any(ks):
        top = -mx.sort(-mx.topk(weights, max(ks), axis=-1), axis=-1)
        kth = mx.take_along_axis(top, mx.array([max(k, 1) - 1 for k in ks])[:, None], axis=-1)
        cut_k = mx.where(mx.array(ks)[:, None] > 0, kth, 0.0)
        cut = mx.maximum(cut, cut_k)
    if any(p.top_p < 1.0 for p in params):
        cut = mx.maximum(cut, _top_p_cut(weights, cut_k, params))
    return mx.where(weights >= cut, weights, 0.0)


def _relative(scaled: mx.array) -> mx.array:
    """e^(x - max x) along the last axis, in one pass after the max: MLX's CPU `exp`
    costs about 12 ns an element, `power` with a constant base a third of that at the
    same accuracy (`engine.models.llama`), and a step samples from the whole vocabulary."""
    # MLX 0.32's shapeless compile crashes on this broadcast over an axis of length 1.
    return mx.ones_like(scaled) if scaled.shape[-1] == 1 else _relative_compiled(scaled)


@partial(mx.compile, shapeless=True)
def _relative_compiled(scaled: mx.array) -> mx.array:
    return mx.power(math.e, scaled - mx.max(scaled, axis=-1, keepdims=True))


def _top_p_cut(weights: mx.array, cut_k: mx.array, params: list[SamplingParams]) -> mx.array:
    V = weights.shape[-1]
    top_p = mx.array([p.top_p for p in params])[:, None]
    in_k = mx.where(weights >= cut_k, weights, 0.0)
    total = mx.sum(in_k, axis=-1, keepdims=True)  # >= 1: the best token's weight is 1
    # A token of weight under (1 - top_p) / V has probability under that too, so the
    # tokens above it already hold more than top_p: no nucleus reaches it. Zeroing such
    # tokens before the sort leaves it mostly ties, which sort several times faster.
    floor = mx.where(top_p < 1.0, (1.0 - top_p) / V, 0.0)
    kept = mx.where(in_k >= floor, in_k, 0.0)
    # The nucleus is looked for among the best NUCLEUS_CANDIDATES tokens first (`topk`
    # finds them in one pass), and among all of them only where those hold less than
    # top_p: the ranks and sums up to the cut are the same either way. Telling which
    # waits for the logits (MLX's own decode step then stops overlapping the host's
    # work; the native step already waits for each draw).
    candidates = min(V, NUCLEUS_CANDIDATES)
    desc = -mx.sort(-mx.topk(kept, candidates, axis=-1), axis=-1)
    probs = desc / total
    mass = mx.cumsum(probs, axis=-1)
    if candidates < V and not mx.all((mass[:, -1:] >= top_p) | (top_p >= 1.0)).item():
        desc = -mx.sort(-kept, axis=-1)
        probs = desc / total
        mass = mx.cumsum(probs, axis=-1)
    before = mass - probs  # mass strictly above each rank
    n = mx.maximum(mx.sum(before < top_p, axis=-1, keepdims=True), 1)
    nth = mx.take_along_axis(desc, (n - 1).astype(mx.int32), axis=-1)
    return mx.where(top_p < 1.0, mx.maximum(nth, floor), 0.0)


def _uniform(row: RowSampler) -> mx.array:
    if row.params.greedy:
        return mx.array(0.0)
    row.key, sub = mx.random.split(row.key)
    return mx.random.uniform(key=sub)
