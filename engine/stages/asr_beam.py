"""Beam search over Whisper's next-token log-probabilities, and its run on the decoder.

Greedy decoding commits to the likeliest next token and cannot take it back: on a short
or unclear clip a wrong first word ("We're right" for "Rear right") decides the rest.
Beam search keeps the `beam_size` likeliest transcripts so far and, once as many have
ended, answers the best of them, ranked as openai-whisper ranks them: the sum of the
log-probabilities (the end token's included) over the number of text tokens. Each live
transcript is extended by its `beam_size + 1` likeliest tokens, so that one that ends
still leaves `beam_size` to extend.

`beam_search` knows no model: `advance(rows, tokens)` continues the live transcripts
`rows` (indices into the previous call's rows, repeated where one transcript branches)
each by its token, and returns the next log-probabilities, one row each.
`run_beam_search` runs it on Whisper's decoder, the live transcripts as its batch rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.llm.decoding_loops import repeated_tail
from engine.models import whisper

__all__ = ["Hypothesis", "beam_search", "log_softmax", "run_beam_search"]

Advance = Callable[[list[int], list[int]], np.ndarray]


@dataclass
class Hypothesis:
    tokens: list[int]  # the forced start, then the decoded tokens
    logprobs: list[float] = field(default_factory=list)  # each decoded token's
    end_logprob: float = 0.0  # the end token's, once it ended
    broken: str | None = None  # why it stopped short: "repetition" or "token cap"

    @property
    def total(self) -> float:
        return sum(self.logprobs) + self.end_logprob

    @property
    def score(self) -> float:
        return self.total / max(len(self.logprobs), 1)


def beam_search(
    first: np.ndarray,
    advance: Advance,
    *,
    beam_size: int,
    eot: int,
    cap: int,
    start: list[int],
    stop_on_loop: bool,
) -> Hypothesis:
    """The best transcript after `start`, from `first`, the first token's (vocab,)
    log-probabilities. A transcript that reaches `cap` tokens (the start's included) or,
    with `stop_on_loop`, ends in a loop stops there, marked broken; one that ended
    cleanly is preferred to any broken one."""
    if beam_size < 1:
        raise ValueError("beam_size must be at least 1")
    live, finished = [Hypothesis(list(start))], list[Hypothesis]()
    logprobs = first[None]
    while live and len(finished) < beam_size:
        grown: list[Hypothesis] = []
        rows: list[int] = []
        for row, token, logprob in _candidates(live, logprobs, beam_size):
            hyp = live[row]
            if token == eot:
                finished.append(Hypothesis(hyp.tokens, hyp.logprobs, logprob))
                continue
            child = Hypothesis([*hyp.tokens, token], [*hyp.logprobs, logprob])
            if stop_on_loop and repeated_tail(child.tokens):
                child.broken = "repetition"
            elif len(child.tokens) >= cap:
                child.broken = "token cap"
            if child.broken is not None:
                finished.append(child)
                continue
            grown.append(child)
            rows.append(row)
            if len(grown) == beam_size:
                break
        live = grown
        if live and len(finished) < beam_size:
            logprobs = advance(rows, [hyp.tokens[-1] for hyp in live])
    return max(finished, key=lambda h: (h.broken is None, h.score))


def run_beam_search(
    decoder: whisper.TextDecoder,
    embedding: mx.array,
    cross_kv: list[tuple[mx.array, mx.array]],
    context: list[int],
    prefix: list[int],
    *,
    suppress: tuple[np.ndarray, np.ndarray],
    beam_size: int,
    eot: int,
    cap: int,
    stop_on_loop: bool,
) -> Hypothesis:
    """`beam_search` on one clip's `cross_kv` (batch 1): the decoder reads `context`,
    then the forced `prefix` the transcript begins with. `suppress`: what is added to
    the first token's logits, then to every later one's."""
    cache = decoder.make_cache()
    last = decoder.hidden(mx.array([context + prefix]), cross_kv, cache)[:, -1]
    first = log_softmax(np.array(last @ embedding.T) + suppress[0])[0]

    def advance(rows: list[int], tokens: list[int]) -> np.ndarray:
        nonlocal cross_kv, cache
        sel = mx.array(rows, dtype=mx.int32)
        cross_kv = [(k[sel], v[sel]) for k, v in cross_kv]
        cache = [[k[sel], v[sel]] for k, v in cache]
        last = decoder.hidden(mx.array([[t] for t in tokens]), cross_kv, cache)[:, -1]
        return log_softmax(np.array(last @ embedding.T) + suppress[1])

    return beam_search(
        first,
        advance,
        beam_size=beam_size,
        eot=eot,
        cap=cap,
        start=prefix,
        stop_on_loop=stop_on_loop,
    )


def log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=-1, keepdims=True)
    out: np.ndarray = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
    return out


def _candidates(
    live: list[Hypothesis], logprobs: np.ndarray, beam_size: int
) -> list[tuple[int, int, float]]:
    """(row, token, log-probability) of each live transcript's `beam_size + 1` likeliest
    next tokens, the likeliest continuations first."""
    width = min(beam_size + 1, logprobs.shape[1])
    totals = [hyp.total for hyp in live]
    out = []
    for row in range(len(live)):
        top = np.argpartition(-logprobs[row], width - 1)[:width]
        out += [(row, int(t), float(logprobs[row, t])) for t in top]
    out.sort(key=lambda c: -(totals[c[0]] + c[2]))
    return out
