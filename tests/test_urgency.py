"""Urgent requests hold the yielding lane between its steps, within their bounds; in the
real engine, an interruption's words hold the answer's LLM."""

from __future__ import annotations

import asyncio
import contextlib
import io
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import soxr

from engine.runtime.lanes import EngineLanes
from engine.runtime.stage import StageOutput
from engine.runtime.urgency import Urgency

ROOT = Path(__file__).resolve().parent.parent


class CountingStage:
    """An answer: `n` outputs per request, one a step."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}

    def add(self, request_id: str, inputs: int) -> None:
        self.left[request_id] = inputs

    def abort(self, request_id: str) -> None:
        self.left.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.left)

    def step(self) -> list[StageOutput]:
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            outs.append(StageOutput(rid, self.left[rid], finished=self.left[rid] == 0))
            if not self.left[rid]:
                del self.left[rid]
        return outs


@dataclass
class Check:
    urgent: bool = True


class HeldCheck:
    """Answers each request in one step, once the test lets it (`go`)."""

    def __init__(self, steps: bool = True) -> None:
        self.steps = steps
        self.live: list[str] = []
        self.stepping = threading.Event()
        self.go = threading.Event()

    def add(self, request_id: str, inputs: Any) -> None:
        self.live.append(request_id)

    def abort(self, request_id: str) -> None:
        self.live.remove(request_id)

    def has_work(self) -> bool:
        return self.steps and bool(self.live)

    def step(self) -> list[StageOutput]:
        self.stepping.set()
        assert self.go.wait(30)
        done, self.live = self.live, []
        return [StageOutput(rid, "words", finished=True) for rid in done]


def _lanes(
    urgency: Urgency, check: HeldCheck | None = None
) -> tuple[EngineLanes, CountingStage, HeldCheck, threading.Event]:
    answer, check = CountingStage(), check or HeldCheck()
    lanes = EngineLanes(
        {"main": {"count": answer}, "small": {"asr": check}},
        yielding={"main": 1},
        urgency=urgency,
    )
    finished = threading.Event()
    lanes.set_output_callback(
        lambda stage, outs: finished.set() if stage == "count" and outs[-1].finished else None
    )
    return lanes, answer, check, finished


def _after_two_turns_of_main(lanes: EngineLanes) -> None:
    """Returns once the main lane has been round its loop since now: a call's answer
    comes before that turn's steps, so the second call's comes after the first's."""
    for _ in range(2):
        lanes.call("count", lambda _: None).result(timeout=10)


@contextlib.contextmanager
def _answer_beside_a_check(
    urgency: Urgency, urgent: bool = True
) -> Iterator[tuple[EngineLanes, CountingStage, HeldCheck, threading.Event]]:
    """The lanes running a check (urgent or not) that lasts until `check.go`, and an
    answer of one step added to the main lane once the check is under way."""
    lanes, answer, check, finished = _lanes(urgency)
    lanes.start()
    try:
        lanes.add("asr", "words0", Check(urgent=urgent))
        assert check.stepping.wait(10)
        lanes.add("count", "answer", 1)
        yield lanes, answer, check, finished
    finally:
        check.go.set()
        lanes.shutdown()


def test_an_urgent_request_holds_the_yielding_lane_until_it_ends() -> None:
    with _answer_beside_a_check(Urgency(max_hold_s=60)) as (lanes, answer, check, finished):
        _after_two_turns_of_main(lanes)
        assert answer.left == {"answer": 1}  # added, never stepped
        check.go.set()
        assert finished.wait(10)
        assert answer.left == {}


def test_a_request_that_is_not_urgent_holds_nothing() -> None:
    with _answer_beside_a_check(Urgency(max_hold_s=60), urgent=False) as (*_, finished):
        assert finished.wait(10)


def test_a_hold_ends_after_its_longest_wait_though_the_urgent_request_runs_on() -> None:
    with _answer_beside_a_check(Urgency(max_hold_s=0.05)) as (_, _, check, finished):
        assert finished.wait(10)
        assert check.live == ["words0"]


def test_aborting_the_urgent_request_lets_the_yielding_lane_go_on() -> None:
    lanes, answer, check, finished = _lanes(Urgency(max_hold_s=60), HeldCheck(steps=False))
    lanes.start()
    try:
        lanes.add("asr", "words0", Check())
        lanes.call("asr", lambda _: None).result(timeout=10)  # the check is in
        lanes.add("count", "answer", 1)
        _after_two_turns_of_main(lanes)
        assert answer.left == {"answer": 1}
        lanes.abort("asr", "words0")
        assert finished.wait(10)
    finally:
        lanes.shutdown()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_after_a_hold_the_lanes_run_as_long_as_they_waited_before_the_next() -> None:
    clock = Clock()
    urgency = Urgency(max_hold_s=0.4, clock=clock)
    urgency.begin("asr", "a")
    assert urgency.hold_s() == pytest.approx(0.4)
    clock.now += 0.15
    urgency.end("asr", "a")
    assert urgency.hold_s() == 0
    clock.now += 0.1
    urgency.begin("asr", "b")  # 0.1 s after a hold of 0.15 s: it holds nothing
    assert urgency.hold_s() == 0
    urgency.end("asr", "b")
    clock.now += 0.06
    urgency.begin("asr", "c")
    assert urgency.hold_s() == pytest.approx(0.4)


def test_an_abort_or_a_failure_ends_the_hold_and_wakes_the_waiting_lanes() -> None:
    woken: list[int] = []
    urgency = Urgency(max_hold_s=60)
    urgency.on_release(lambda: woken.append(1))
    urgency.begin("asr", "a")
    urgency.begin("asr", "b")
    urgency.end("asr", "a")
    assert urgency.hold_s() > 0 and woken == [1]
    urgency.end("asr", "b")
    urgency.end("asr", "b")  # ended once only
    assert urgency.hold_s() == 0 and woken == [1, 1]


def test_pause_returns_at_once_without_a_hold_and_waits_out_a_holds_bound() -> None:
    urgency = Urgency(max_hold_s=0.2)
    started = time.monotonic()
    urgency.pause()
    urgency.begin("asr", "a")
    urgency.pause()
    assert time.monotonic() - started >= 0.2  # the hold's bound: its end, not a guess
    assert urgency.hold_s() == 0


def test_pause_returns_when_the_urgent_request_ends() -> None:
    urgency = Urgency(max_hold_s=60)
    urgency.begin("asr", "a")
    ending = threading.Thread(target=urgency.end, args=("asr", "a"))
    started = time.monotonic()
    ending.start()
    urgency.pause()  # waits a minute unless the end wakes it
    ending.join()
    assert time.monotonic() - started < 30
    assert urgency.hold_s() == 0


def _spoken(text: str) -> np.ndarray:
    wav = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True, check=True).stdout
    audio, rate = sf.read(io.BytesIO(wav), dtype="float32")
    return soxr.resample(audio, rate, 16000).astype(np.float32)


# Long enough that the LLM decodes many tokens while it is transcribed, unless held.
SPEECH = "Hold on, can we talk about the weather in Paris tomorrow morning instead?"


@pytest.mark.models
async def test_the_words_of_an_interruption_hold_the_answers_llm_in_the_real_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine import build
    from engine.config import load_config
    from engine.llm.stage import LlmInput
    from engine.runtime.request import SamplingParams
    from engine.stages.asr_request import AsrRequest

    monkeypatch.setattr(build, "URGENT_HOLD_S", 60.0)  # held for the whole check, however slow
    bundle = await build.build_engine(
        load_config(ROOT / "configs" / "default.yaml"), progress=False
    )
    engine = bundle.engine
    try:
        story = [{"role": "user", "content": "Write a long story about a lighthouse."}]
        answer = LlmInput(messages=story, sampling_params=SamplingParams(max_tokens=300))
        tokens = engine.stream("llm", "answer", answer)
        await tokens.__anext__()  # the answer is decoding
        during: list[Any] = []
        checking = True

        async def count() -> None:
            async for out in tokens:
                if checking:
                    during.append(out)

        counter = asyncio.create_task(count())
        clip = np.concatenate([np.zeros(4800, np.float32), _spoken(SPEECH)])
        words = [o async for o in engine.stream("asr", "words0", AsrRequest(clip, urgent=True))]
        checking = False
        assert "hold" in words[-1].payload.text.lower()
        # Only steps begun before the ASR lane took the check in: the one under way, and
        # one or two while the check was on its way there. Unheld, the answer decoded 8
        # tokens meanwhile (2 held), on a 2-core x86_64.
        assert len(during) <= 3
        counter.cancel()
        engine.abort("llm", "answer")
    finally:
        await bundle.aclose()


@pytest.mark.models
async def test_a_long_prefill_gives_way_to_an_interruptions_words_in_the_real_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine import build
    from engine.config import load_config
    from engine.llm.stage import LlmInput
    from engine.runtime.request import SamplingParams
    from engine.stages.asr_request import AsrRequest

    monkeypatch.setattr(build, "URGENT_HOLD_S", 60.0)
    prefilling = threading.Event()
    held_layers: list[int] = []  # a layer the prefill ended while a hold was on
    pause = Urgency.pause

    def recorded(self: Urgency) -> None:
        prefilling.set()
        if self.hold_s():
            held_layers.append(1)
        pause(self)

    monkeypatch.setattr(Urgency, "pause", recorded)
    bundle = await build.build_engine(
        load_config(ROOT / "configs" / "default.yaml"), progress=False
    )
    engine = bundle.engine
    try:
        prefilling.clear()  # the warm-up's prefill is over
        text = " ".join(["The keeper climbed the stairs and lit the great lamp."] * 80)
        long_turn = [{"role": "user", "content": f"Summarize this: {text}"}]
        answer = LlmInput(messages=long_turn, sampling_params=SamplingParams(max_tokens=4))
        tokens = engine.stream("llm", "answer", answer)
        first = asyncio.ensure_future(tokens.__anext__())
        assert await asyncio.to_thread(prefilling.wait, 60)  # its first forward is under way
        clip = np.concatenate([np.zeros(4800, np.float32), _spoken(SPEECH)])
        words = [o async for o in engine.stream("asr", "words0", AsrRequest(clip, urgent=True))]
        assert "hold" in words[-1].payload.text.lower()
        # The prompt's forwards (about a thousand tokens, in slices of 64 or fewer) were
        # still under way when the check came. The one in flight ran on at most to the
        # end of its layer, then waited there (none ran, when the check came between two
        # forwards); a forward that kept going would end a layer every few ms of the
        # check's hundred or more.
        assert len(held_layers) <= 1
        await first  # and the answer goes on once the check is done
        engine.abort("llm", "answer")
    finally:
        await bundle.aclose()
