"""Per-session prompt cache: a conversation's KV survives between its turns.

An entry maps a session key to the tokens whose KV it holds and one `KVCache` per
layer. A new turn takes the entry, keeps the longest common token prefix with its
prompt and trims the rest, so only new tokens are prefilled. Because the match is by
common prefix, a history cut back after a barge-in simply reuses less. Entries are
evicted least recently used first to stay within a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PromptCache", "CacheHit", "common_prefix_length"]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class _Entry:
    tokens: list[int]
    layers: list[Any]
    nbytes: int


@dataclass
class CacheHit:
    """Layers trimmed to `num_tokens` reused tokens, and how the prompt matched."""

    layers: list[Any]
    num_tokens: int
    hit_type: str  # "exact", "prefix" (cache ⊂ prompt) or "lcp" (diverged)


class PromptCache:
    """LRU map session key -> (tokens, per-layer KV), bounded by `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"prompt cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def take(self, key: str, prompt: Sequence[int]) -> CacheHit | None:
        """Remove and return the entry for `key`, trimmed to what `prompt` can reuse.

        At least one prompt token is always left to compute, since its logits give
        the first output token. Returns None when nothing is reusable.
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry.nbytes
        common = common_prefix_length(entry.tokens, prompt)
        reuse = min(common, len(prompt) - 1)
        if reuse <= 0:
            return None
        for layer in entry.layers:
            layer.trim(layer.offset - reuse)
        if common == len(entry.tokens) == len(prompt):
            hit_type = "exact"
        elif common == len(entry.tokens):
            hit_type = "prefix"
        else:
            hit_type = "lcp"
        return CacheHit(entry.layers, reuse, hit_type)

    def put(self, key: str, tokens: Sequence[int], layers: list[Any]) -> None:
        """Store (or replace) a session's KV; evicts older sessions past the budget."""
        self.discard(key)
        nbytes = sum(layer.nbytes for layer in layers)
        if not tokens or nbytes > self.max_bytes:
            return
        self._entries[key] = _Entry(list(tokens), layers, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def discard(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
