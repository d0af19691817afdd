"""What the LLM stage keeps for a session lives as long as the session: a closed
session's cached context is freed, and a live one's is never pushed out by the sessions
that came and went around it. On a tiny random llama and a byte tokenizer."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache
from test_llm_stage import greedy, make_stage, prompt, run, tiny_model

from engine.llm.prompt_cache import PromptCache
from engine.llm.stage import LlmInput, LlmStage


@pytest.fixture(scope="module")
def model() -> llama.Model:
    return tiny_model()


def _layers(n_tokens: int) -> list[KVCache]:
    layer = KVCache()
    k = mx.zeros((1, 1, n_tokens, 4))
    layer.update_and_fetch(k, k)
    return [layer]


def turn(stage: LlmStage, rid: str, key: str, ids: list[int], max_tokens: int = 6) -> list[int]:
    stage.add(
        rid, LlmInput(prompt_token_ids=ids, sampling_params=greedy(max_tokens), cache_key=key)
    )
    return run(stage)[rid][-1].output_token_ids


def test_a_pinned_entry_is_never_evicted() -> None:
    one = sum(layer.nbytes for layer in _layers(8))
    cache = PromptCache(3 * one)
    cache.put("prefix", [1] * 8, _layers(8), pinned=True)
    for n in range(6):
        cache.put(f"s{n}", [2, n] + [3] * 6, _layers(8))
    assert "prefix" in cache and len(cache) == 3 and cache.nbytes <= 3 * one
    cache.discard("prefix")
    assert "prefix" not in cache


def test_forget_frees_a_closed_sessions_kv(model: llama.Model) -> None:
    stage = make_stage(model)
    turn(stage, "t1", "gone", prompt(30))
    assert stage.cache_stats()["llm_prompt_cache"][0] == 1
    stage.forget("gone")
    assert stage.cache_stats()["llm_prompt_cache"] == (0, 0)
    assert stage.cache_stats()["llm_live_kv"] == (0, 0)


def test_a_request_still_running_when_its_session_ends_stores_nothing(
    model: llama.Model,
) -> None:
    stage = make_stage(model)
    stage.add(
        "t1", LlmInput(prompt_token_ids=prompt(30), sampling_params=greedy(50), cache_key="gone")
    )
    for _ in range(3):
        stage.step()
    stage.forget("gone")  # the session closed; the abort of its request comes after
    stage.abort("t1")
    assert stage.cache_stats() == {"llm_prompt_cache": (0, 0), "llm_live_kv": (0, 0)}


def test_a_live_session_hits_its_cache_after_many_sessions_came_and_went(
    model: llama.Model,
) -> None:
    # A budget of about three conversations: without `forget`, the sessions that came and
    # went would push the live one's context out.
    stage = make_stage(model)
    first = prompt(40)
    reply = turn(stage, "a1", "live", first)
    stage.prompt_cache.max_bytes = 3 * stage.prompt_cache.nbytes
    for n in range(8):
        turn(stage, f"s{n}", f"gone{n}", prompt(44, n + 1))
        stage.forget(f"gone{n}")
    assert len(stage.prompt_cache) == 1
    new = prompt(9, 99)
    before = stage.token_counts["prefill"]
    stage.add(
        "a2",
        LlmInput(prompt_token_ids=first + reply + new, sampling_params=greedy(4), cache_key="live"),
    )
    req = stage.request("a2")
    assert req is not None
    run(stage)
    assert req.cache_hit_type == "prefix" and req.cached_tokens == len(first + reply)
    assert stage.token_counts["prefill"] - before == len(new)
