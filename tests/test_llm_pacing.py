"""The LLM stage keeps pace with speech (rule 3 of engine/llm/scheduler.py) and ages prefills.

A tiny random llama and a hand-set clock; the engine-thread test uses the real clock
and waits on the finished output, never on a sleep.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from engine.llm.stage import AHEAD_S, PREFILL_AGEING_TOKENS_PER_S, LlmInput, LlmStage
from engine.runtime.core import EngineCore
from engine.runtime.stage import StageOutput
from tests.test_llm_stage import EOS, ByteTokenizer, greedy, prompt, tiny_model


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


def test_decode_can_wait_while_every_row_has_speech_queued(model: llama.Model) -> None:
    stage, clock = paced_stage(model)
    start(stage, "a", "b")
    stage.set_runway("a", AHEAD_S + 5)
    assert not stage.deferrable()  # b has told nothing: it may be short
    stage.set_runway("b", AHEAD_S + 2)
    assert stage.deferrable()
    clock.now += 2.5  # b's speech has run down to under AHEAD_S
    assert not stage.deferrable()
    # Stepped anyway (in slack), it decodes every row.
    assert tokens(stage.step()) == {"a": 1, "b": 1}


def test_a_waiting_prompt_is_never_deferred(model: llama.Model) -> None:
    stage, _ = paced_stage(model, prefill_slice_tokens=8)
    start(stage, "a")
    stage.set_runway("a", AHEAD_S + 10)
    assert stage.deferrable()
    stage.add("new", LlmInput(prompt_token_ids=prompt(30, 9), sampling_params=greedy(4)))
    assert not stage.deferrable()


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


class Busy:
    """A stage that is given `steps` steps of work by `arm`, and logs what ran."""

    name = "busy"

    def __init__(self, log: list[str]) -> None:
        self.left, self.log = 0, log

    def arm(self, steps: int) -> None:
        self.left = steps
        self.log.append("arm")

    def add(self, request_id: str, inputs: object) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> list[StageOutput]:
        self.left -= 1
        self.log.append("busy")
        return []


class Logged(LlmStage):
    log: list[str]

    def step(self) -> list[StageOutput]:
        self.log.append("llm")
        return super().step()


def never_eos(tokens: mx.array, logits: mx.array) -> mx.array:
    return logits + mx.where(mx.arange(logits.shape[-1]) == EOS, -1e9, 0.0)


def test_deferrable_work_runs_only_when_the_lane_has_slack(model: llama.Model) -> None:
    log: list[str] = []
    llm = Logged(model, ByteTokenizer())
    llm.log = log
    core = EngineCore({"busy": Busy(log), "llm": llm})
    first, finished = threading.Event(), threading.Event()

    def on_outputs(stage: str, outputs: list[StageOutput]) -> None:
        first.set()
        if any(o.finished for o in outputs):
            finished.set()

    core.set_output_callback(on_outputs)
    core.start()
    try:
        params = greedy(400, logits_processors=[never_eos])
        core.add("llm", "a", LlmInput(prompt_token_ids=prompt(6), sampling_params=params))
        assert first.wait(timeout=60)
        core.call("llm", lambda llm: llm.set_runway("a", AHEAD_S + 600)).result(timeout=60)
        core.call("busy", lambda busy: busy.arm(5)).result(timeout=60)
        assert finished.wait(timeout=120)  # the deferred decode ran once the lane was idle
    finally:
        core.shutdown()
    armed = log[log.index("arm") + 1 :]
    assert armed[:5] == ["busy"] * 5 and armed[5:] and set(armed[5:]) == {"llm"}
