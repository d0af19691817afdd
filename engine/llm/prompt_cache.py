"""Per-session prompt cache: a conversation's KV survives between its turns.

An entry maps a session key to the tokens whose KV it holds and one `KVCache` per
layer. A new turn takes the entry, keeps the longest common token prefix with its
prompt and trims the rest, so only new tokens are prefilled. Because the match is by
common prefix, a history cut back after a barge-in simply reuses less. Entries are
evicted least recently used first to stay within a byte budget; a pinned entry (the
system-prompt prefix every session copies) never is. A session's entry lives as long as
the session: whoever ends the session discards it (`LlmStage.forget`), so the budget is
shared by live sessions only and a closed one never pushes a live one out.

Sessions also share prefixes: every conversation starts with the same system prompt and
chat template, so a turn whose own entry reuses less than another entry gets a copy of
that entry's common prefix. The other entry is never changed: the copy holds new
`KVCache` objects over slices of its arrays, and MLX arrays are values, so later writes
into the copy make new arrays instead of writing into the shared ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import KVCache

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
    shared_from: str | None = None  # the other key whose prefix was copied, if any


class PromptCache:
    """LRU map session key -> (tokens, per-layer KV), bounded by `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"prompt cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._pinned: set[str] = set()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def take(self, key: str, prompt: Sequence[int]) -> CacheHit | None:
        """The KV `prompt` can reuse: `key`'s own entry (removed from the cache, trimmed)
        or, when another entry shares a longer prefix, a copy of that prefix.

        At least one prompt token is always left to compute, since its logits give
        the first output token. Returns None when nothing is reusable.
        """
        own = self._pop(key)
        own_common = common_prefix_length(own.tokens, prompt) if own is not None else 0
        other, other_common = self._longest_shared(prompt)
        limit = len(prompt) - 1
        if other is not None and min(other_common, limit) > min(own_common, limit):
            return self._copy_prefix(other, prompt, min(other_common, limit))
        if own is None or min(own_common, limit) <= 0:
            return None
        reuse = min(own_common, limit)
        for layer in own.layers:
            layer.trim(layer.offset - reuse)
        return CacheHit(own.layers, reuse, _hit_type(own.tokens, prompt, own_common))

    def put(
        self, key: str, tokens: Sequence[int], layers: list[Any], *, pinned: bool = False
    ) -> None:
        """Store (or replace) a session's KV; evicts the least recently used unpinned
        entries past the budget. A pinned entry stays until discarded."""
        self.discard(key)
        nbytes = sum(layer.nbytes for layer in layers)
        if not tokens or nbytes > self.max_bytes:
            return
        self._entries[key] = _Entry(list(tokens), layers, nbytes)
        self.nbytes += nbytes
        if pinned:
            self._pinned.add(key)
        for old in [k for k in self._entries if k not in self._pinned]:
            if self.nbytes <= self.max_bytes:
                break
            self._pop(old)

    def discard(self, key: str) -> None:
        self._pop(key)
        self._pinned.discard(key)

    def _pop(self, key: str) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry

    def _longest_shared(self, prompt: Sequence[int]) -> tuple[str | None, int]:
        best, best_len = None, 0
        for key, entry in self._entries.items():
            n = common_prefix_length(entry.tokens, prompt)
            if n > best_len:
                best, best_len = key, n
        return best, best_len

    def _copy_prefix(self, key: str, prompt: Sequence[int], reuse: int) -> CacheHit:
        entry = self._entries[key]
        self._entries.move_to_end(key)  # a prefix others reuse stays in the cache longest
        layers = [_prefix_copy(layer, reuse) for layer in entry.layers]
        hit_type = _hit_type(entry.tokens, prompt, common_prefix_length(entry.tokens, prompt))
        return CacheHit(layers, reuse, hit_type, shared_from=key)


def _prefix_copy(layer: Any, n: int) -> KVCache:
    copy = KVCache()
    copy.keys = layer.keys[..., :n, :]
    copy.values = layer.values[..., :n, :]
    copy.offset = n
    return copy


def _hit_type(cached: Sequence[int], prompt: Sequence[int], common: int) -> str:
    if common == len(cached) == len(prompt):
        return "exact"
    if common == len(cached):
        return "prefix"
    return "lcp"
