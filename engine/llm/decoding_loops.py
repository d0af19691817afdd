"""A greedy decoder caught in a loop: the block its tokens end by repeating, and the
tokens with one copy of that block kept."""

from __future__ import annotations

__all__ = ["collapse_loop", "repeated_tail"]


def repeated_tail(tokens: list[int], max_period: int = 16) -> int:
    """Length of the block the sequence ends by repeating in a loop, or 0.

    A block of 2+ tokens repeated 3 times, or one token repeated 5 times, counts.
    """
    n = len(tokens)
    for p in range(1, min(max_period, n // 3) + 1):
        need = 5 if p == 1 else 3
        if n < p * need:
            continue
        block = tokens[n - p :]
        if all(tokens[n - (k + 1) * p : n - k * p] == block for k in range(1, need)):
            return p
    return 0


def collapse_loop(tokens: list[int], keep: int = 0) -> list[int]:
    # Keep one copy of a block the decoder kept repeating until the cap; never cut into
    # the first `keep` tokens (a forced prefix).
    p = repeated_tail(tokens)
    while p and len(tokens) - 2 * p >= keep:
        block = tokens[-p:]
        while tokens[-2 * p : -p] == block and len(tokens) - 2 * p >= keep:
            tokens = tokens[:-p]
        p = repeated_tail(tokens)
    return tokens
