"""Per-session prompt cache: common-prefix reuse, trimming and LRU by bytes."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.llm.prompt_cache import PromptCache, common_prefix_length


def _layers(n_tokens: int, n_layers: int = 2) -> list[KVCache]:
    layers = []
    for _ in range(n_layers):
        c = KVCache()
        k = mx.arange(n_tokens, dtype=mx.float32).reshape(1, 1, n_tokens, 1)
        c.update_and_fetch(k, k)
        layers.append(c)
    return layers


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


def test_prefix_hit_reuses_everything_cached() -> None:
    cache = PromptCache(10**9)
    cache.put("s", [1, 2, 3, 4], _layers(4))
    hit = cache.take("s", [1, 2, 3, 4, 5, 6])
    assert hit is not None and hit.num_tokens == 4 and hit.hit_type == "prefix"
    assert all(layer.offset == 4 for layer in hit.layers)
    assert "s" not in cache  # taken while in use


def test_diverged_history_is_trimmed_to_common_prefix() -> None:
    # E.g. after a barge-in the assistant's turn was cut short in history.
    cache = PromptCache(10**9)
    cache.put("s", [1, 2, 3, 4, 5, 6], _layers(6))
    hit = cache.take("s", [1, 2, 3, 9, 9])
    assert hit is not None and hit.num_tokens == 3 and hit.hit_type == "lcp"
    assert hit.layers[0].offset == 3
    keys, _ = hit.layers[0].keys_and_values()
    assert keys.reshape(-1).tolist() == [0.0, 1.0, 2.0]


def test_exact_hit_leaves_one_token_to_compute() -> None:
    cache = PromptCache(10**9)
    cache.put("s", [1, 2, 3], _layers(3))
    hit = cache.take("s", [1, 2, 3])
    assert hit is not None and hit.num_tokens == 2 and hit.hit_type == "exact"


def test_miss_and_no_overlap() -> None:
    cache = PromptCache(10**9)
    assert cache.take("absent", [1, 2]) is None
    cache.put("s", [5, 6], _layers(2))
    assert cache.take("s", [1, 2]) is None


def test_lru_eviction_by_bytes() -> None:
    one = sum(layer.nbytes for layer in _layers(4))
    cache = PromptCache(2 * one)
    cache.put("a", [1, 2, 3, 4], _layers(4))
    cache.put("b", [1, 2, 3, 4], _layers(4))
    assert cache.take("a", [1, 2, 3, 4, 5]) is not None  # "a" used, then put back
    cache.put("a", [1, 2, 3, 4], _layers(4))
    cache.put("c", [1, 2, 3, 4], _layers(4))  # evicts "b", the least recently used
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.nbytes == 2 * one


def test_entry_larger_than_budget_is_not_stored() -> None:
    cache = PromptCache(16)
    cache.put("s", [1, 2, 3, 4], _layers(4))
    assert len(cache) == 0 and cache.nbytes == 0


def test_new_key_copies_the_longest_shared_prefix_of_another_entry() -> None:
    cache = PromptCache(10**9)
    cache.put("short", [1, 2, 9], _layers(3))
    cache.put("system", [1, 2, 3, 4], _layers(4))
    hit = cache.take("new", [1, 2, 3, 4, 7, 8])
    assert hit is not None and hit.shared_from == "system"
    assert hit.num_tokens == 4 and hit.hit_type == "prefix"
    assert all(layer.offset == 4 for layer in hit.layers)
    assert "system" in cache and "short" in cache  # the source stays for others


def test_shared_copy_never_changes_the_source_entry() -> None:
    cache = PromptCache(10**9)
    cache.put("system", [1, 2, 3, 4], _layers(4))
    hit = cache.take("new", [1, 2, 3, 5, 6])
    assert hit is not None and hit.num_tokens == 3 and hit.hit_type == "lcp"
    ones = mx.ones((1, 1, 2, 1))
    for layer in hit.layers:
        keys, _ = layer.update_and_fetch(ones * 100, ones * 100)
        assert keys.reshape(-1).tolist() == [0.0, 1.0, 2.0, 100.0, 100.0]
    again = cache.take("other", [1, 2, 3, 4, 5])
    assert again is not None and again.num_tokens == 4
    keys, _ = again.layers[0].keys_and_values()
    assert keys.reshape(-1).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_own_entry_wins_unless_another_shares_more() -> None:
    cache = PromptCache(10**9)
    cache.put("system", [1, 2], _layers(2))
    cache.put("s", [1, 2, 3, 4], _layers(4))
    hit = cache.take("s", [1, 2, 3, 4, 5])
    assert hit is not None and hit.shared_from is None and hit.num_tokens == 4
    assert "s" not in cache
    cache.put("s", [1, 9], _layers(2))  # e.g. the session changed its instructions
    hit = cache.take("s", [1, 2, 3])
    assert hit is not None and hit.shared_from == "system" and hit.num_tokens == 2
    assert "s" not in cache  # the stale entry is dropped; the turn puts a fresh one
