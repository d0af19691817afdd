"""The LLM stage keeps pace with speech (rule 6 of engine/llm.py) and ages prefills.

A tiny random llama and a hand-set clock; the engine-thread test uses the real clock
and waits on the finished output, never on a sleep.
"""

from __future__ import annotations

import threading

import engine  # noqa: F401 - first, so MLX picks up the optimised BLAS

# isort: split
import pytest
from mlx_lm.models import llama

from engine.core import EngineCore
from engine.llm import AHEAD_S, PREFILL_AGEING_TOKENS_PER_S, LlmInput, LlmStage
from engine.stage import StageOutput
from tests.test_llm_stage import ByteTokenizer, greedy, prompt, tiny_model


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def model() -> llama.Model:
    return tiny_model()


def paced_stage(model: llama.Model, **kw: object) -> tuple[LlmStage, Clock]:
    clock = Clock()
    return LlmStage(model, ByteTokenizer(), clock=clock, **kw), clock  # type: ignore[arg-type]


def tokens(outputs: list[StageOutput]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for out in outputs:
        counts[out.request_id] = counts.get(out.request_id, 0) + len(out.payload.new_token_ids)
    return counts


def start(stage: LlmStage, *ids: str, max_tokens: int = 40) -> None:
    for i, rid in enumerate(ids):
        stage.add(rid, LlmInput(prompt_token_ids=prompt(6, i), sampling_params=greedy(max_tokens)))
    for _ in range(3):  # prefill, then a first decode: every row is running
        stage.step()
    assert stage.stats()["running"] == len(ids)


def test_decode_waits_while_every_row_has_speech_queued(model: llama.Model) -> None:
    stage, clock = paced_stage(model)
    start(stage, "a", "b")
    stage.set_runway("a", AHEAD_S + 5)
    stage.set_runway("b", AHEAD_S + 2)
    assert not stage.has_work()
    assert stage.step() == []
    assert stage.wake_in() == pytest.approx(2.0)
    clock.now += 2.5  # b's speech has run down to under AHEAD_S
    assert stage.has_work() and stage.wake_in() is None
    assert tokens(stage.step()) == {"a": 1, "b": 1}


def test_a_row_short_of_speech_keeps_the_batch_decoding(model: llama.Model) -> None:
    stage, _ = paced_stage(model)
    start(stage, "long", "short")
    stage.set_runway("long", AHEAD_S + 30)
    stage.set_runway("short", 0.5)
    for _ in range(3):
        assert tokens(stage.step()).get("short") == 1


def test_a_new_turn_is_prefilled_while_the_others_wait(model: llama.Model) -> None:
    stage, _ = paced_stage(model, prefill_slice_tokens=8)
    start(stage, "a")
    stage.set_runway("a", AHEAD_S + 10)
    stage.add("new", LlmInput(prompt_token_ids=prompt(30, 9), sampling_params=greedy(4)))
    assert stage.has_work()
    slices = 0
    while not (outputs := stage.step()):
        slices += 1  # a slice of the new prompt only: a waits
    assert slices >= 2
    assert [o.request_id for o in outputs] == ["new", "a"]  # the new row is due: all decode


def test_runway_for_a_finished_request_is_ignored(model: llama.Model) -> None:
    stage, _ = paced_stage(model)
    stage.set_runway("gone", 10.0)
    assert not stage.has_work()


def test_a_long_prompt_ages_past_a_stream_of_short_ones(model: llama.Model) -> None:
    stage, clock = paced_stage(model, prefill_slice_tokens=8, prefill_chunk_tokens=64)
    stage.add("long", LlmInput(prompt_token_ids=prompt(120), sampling_params=greedy(2)))
    stage.step()  # admitted: one slice of it
    done_before = stage.request("long").num_computed_tokens  # type: ignore[union-attr]
    # A short turn arrives: with no wait behind "long", shortest-first serves it first.
    stage.add("s0", LlmInput(prompt_token_ids=prompt(4, 1), sampling_params=greedy(2)))
    assert "s0" in tokens(stage.step())
    assert stage.request("long").num_computed_tokens == done_before  # type: ignore[union-attr]
    # After long enough a wait, the long prompt goes before a newly arrived short one.
    clock.now += 2 * 120 / PREFILL_AGEING_TOKENS_PER_S
    stage.add("s1", LlmInput(prompt_token_ids=prompt(4, 2), sampling_params=greedy(2)))
    stage.step()
    assert stage.request("long").num_computed_tokens > done_before  # type: ignore[union-attr]


def test_the_engine_thread_wakes_a_paused_decode_by_itself(model: llama.Model) -> None:
    stage = LlmStage(model, ByteTokenizer())
    core = EngineCore({"llm": stage})
    finished = threading.Event()
    core.set_output_callback(lambda _, outs: any(o.finished for o in outs) and finished.set())
    core.start()
    try:
        params = greedy(30)
        core.add("llm", "a", LlmInput(prompt_token_ids=prompt(6), sampling_params=params))
        # Paused for about a quarter second, then due again: no further call wakes it.
        core.call("llm", "set_runway", "a", AHEAD_S + 0.25).result(timeout=60)
        assert finished.wait(timeout=60)
    finally:
        core.shutdown()
