"""The engine thread and its asyncio facade, driven by small recording stages."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from typing import Any

import pytest

from engine.runtime.core import AsyncEngine, EngineCore
from engine.runtime.stage import RequestRefused, StageOutput
from engine.runtime.streams import OutputStreams
from tests.helpers import wait_until, wait_until_blocking


class CountingStage:
    """Emits `n` outputs per request, one per step, recording the order of calls."""

    name = "count"

    def __init__(self, delay: float = 0.0) -> None:
        self.left: dict[str, int] = {}
        self.log: list[tuple[str, str]] = []
        self.delay = delay
        self.thread_ids: set[int] = set()

    def add(self, request_id: str, inputs: Any) -> None:
        self.thread_ids.add(threading.get_ident())
        if inputs == "too much":
            raise RequestRefused("too_much", "asks for too much")
        if not isinstance(inputs, int) or inputs < 1:
            raise ValueError("inputs must be a positive int")
        self.log.append(("add", request_id))
        self.left[request_id] = inputs

    def abort(self, request_id: str) -> None:
        self.log.append(("abort", request_id))
        self.left.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.left)

    def step(self) -> list[StageOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.delay:
            time.sleep(self.delay)  # stands in for model compute on the engine thread
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            outs.append(StageOutput(rid, self.left[rid], finished=done))
            if done:
                del self.left[rid]
        return outs

    def echo(self, value: Any) -> Any:
        self.log.append(("echo", value))
        return value


class FailingStage(CountingStage):
    def step(self) -> list[StageOutput]:
        raise RuntimeError("boom")


@pytest.fixture
def core() -> Any:
    stages = {"count": CountingStage(), "fail": FailingStage()}
    engine = EngineCore(stages)
    engine.start()
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncEngine, stage: str, rid: str, inputs: Any) -> list[StageOutput]:
    return [out async for out in engine.stream(stage, rid, inputs)]


async def test_stream_ends_after_finished_output(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    outs = await _collect(engine, "count", "a", 3)
    assert [o.payload for o in outs] == [2, 1, 0]
    assert outs[-1].finished and core.pending()["count"] == 0


async def test_stages_run_on_the_engine_thread_only(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    await _collect(engine, "count", "a", 2)
    stage = core._stages["count"]
    assert stage.thread_ids == {core._thread.ident}


async def test_invalid_inputs_fail_only_that_request(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    bad, good = await asyncio.gather(
        _collect(engine, "count", "bad", -1), _collect(engine, "count", "good", 2)
    )
    assert bad[-1].finished and "positive int" in bad[-1].error
    assert [o.payload for o in good] == [1, 0] and good[-1].error is None


async def test_a_refusal_carries_its_code_and_plain_message(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    refused = await _collect(engine, "count", "r", "too much")
    assert [(o.finished, o.error, o.error_code) for o in refused] == [
        (True, "asks for too much", "too_much")
    ]
    invalid = await _collect(engine, "count", "v", -1)
    assert invalid[-1].error_code is None


async def test_stage_exception_fails_its_requests_not_the_thread(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    failed = await _collect(engine, "fail", "x", 5)
    assert failed[-1].finished and "boom" in failed[-1].error
    assert core.pending()["fail"] == 0
    outs = await _collect(engine, "count", "after", 1)
    assert outs[-1].payload == 0


async def test_call_runs_in_order_with_adds(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    core.add("count", "a", 1)
    assert await engine.run("count", lambda stage: stage.echo(7)) == 7
    stage = core._stages["count"]
    assert stage.log.index(("add", "a")) < stage.log.index(("echo", 7))


async def test_call_propagates_exceptions(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    with pytest.raises(AttributeError):
        await engine.run("count", lambda stage: stage.no_such_method())


async def test_abort_delivers_nothing_more_and_frees(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    it = engine.stream("count", "long", 10_000)
    first = await it.__anext__()
    assert not first.finished
    engine.abort("count", "long")
    rest = [o async for o in it]
    assert rest == []
    await engine.run("count", lambda stage: stage.echo("sync"))  # after the abort
    assert core.pending()["count"] == 0
    assert ("abort", "long") in core._stages["count"].log


async def test_abort_of_queued_add_never_reaches_stage() -> None:
    stage = CountingStage()
    core = EngineCore({"count": stage})
    core.add("count", "q", 3)
    core.abort("count", "q")
    core.start()
    try:
        assert core.call("count", lambda stage: stage.echo(1)).result(timeout=5) == 1
        assert ("add", "q") not in stage.log and core.pending()["count"] == 0
    finally:
        core.shutdown()


async def test_leaving_a_stream_early_aborts_it(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    # `aclosing` runs the stream's cleanup at the break; a bare `break` leaves it to the
    # garbage collector's finalizer task, a tick later.
    stream = engine.stream("count", "early", 10_000)
    async with contextlib.aclosing(stream):
        async for _ in stream:
            break
    await engine.run("count", lambda stage: stage.echo("sync"))
    assert core.pending()["count"] == 0


async def test_event_loop_keeps_running_while_stages_compute() -> None:
    # A slow stage must not stall the loop: a ticker keeps ticking during the stream.
    core = EngineCore({"count": CountingStage(delay=0.02)})
    core.start()
    engine = AsyncEngine(core)
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        outs = await _collect(engine, "count", "slow", 10)
        done.set()
        await task
        assert len(outs) == 10
        assert ticks > len(outs) * 5
    finally:
        core.shutdown()


async def test_outputs_cross_in_one_handover_per_step() -> None:
    core = EngineCore({"count": CountingStage()})
    core.start()
    engine = AsyncEngine(core)
    calls = 0
    loop = asyncio.get_running_loop()
    original = loop.call_soon_threadsafe

    def counting(*args: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args, **kw)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(_collect(engine, "count", f"r{i}", 5) for i in range(8)))
        assert all(len(r) == 5 for r in results)
        # 40 outputs in at most 5 steps (plus one step of slack for admission timing).
        assert calls <= 10
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]
        core.shutdown()


async def test_slow_consumer_overflow_fails_the_stream() -> None:
    stage = CountingStage()
    core = EngineCore({"count": stage})
    core.start()
    engine = AsyncEngine(core, max_queued_outputs=4)
    try:
        it = engine.stream("count", "flood", 100)
        # Not consuming: the fifth queued output overflows, which aborts the request.
        await wait_until(lambda: ("add", "flood") in stage.log, 5, "the flood to start")
        await wait_until(lambda: core.pending()["count"] == 0, 5, "the flood to be aborted")
        outs = [o async for o in it]
        assert outs[-1].finished and "overflow" in outs[-1].error
        assert len(outs) <= 5
    finally:
        core.shutdown()


def test_idle_engine_sleeps_without_stepping() -> None:
    stage = CountingStage()
    steps = 0
    original = stage.step

    def counted() -> list[StageOutput]:
        nonlocal steps
        steps += 1
        return original()

    stage.step = counted  # type: ignore[method-assign]
    core = EngineCore({"count": stage})
    core.start()
    try:
        # Each call wakes the idle engine for one full pass; no pass steps a stage
        # that has no work.
        for _ in range(3):
            assert core.call("count", lambda stage: stage.echo(0)).result(timeout=5) == 0
        assert steps == 0
        core.add("count", "a", 2)
        assert core.call("count", lambda stage: stage.echo(0)).result(timeout=5) == 0
        wait_until_blocking(lambda: not core.pending()["count"], 5, "the engine to drain")
        assert steps == 2
    finally:
        core.shutdown()


def test_unknown_stage_is_rejected() -> None:
    core = EngineCore({"count": CountingStage()})
    with pytest.raises(KeyError, match="unknown stage"):
        core.add("nope", "r", 1)


async def test_stream_on_unknown_stage_raises_and_leaves_nothing(core: EngineCore) -> None:
    engine = AsyncEngine(core)
    with pytest.raises(KeyError):
        engine.stream("nope", "r", 1)
    assert len(engine._streams) == 0


# --- the output streams both the facade and the remote LLM use ------------------------


async def test_output_stream_ends_after_its_finished_output() -> None:
    aborted: list[str] = []
    streams: OutputStreams[str] = OutputStreams(aborted.append)
    it = streams.open("r")
    streams.put("r", StageOutput("r", 1))
    streams.put("r", StageOutput("r", 2, finished=True))
    streams.put("r", StageOutput("r", 3))  # after the end: dropped
    assert [o.payload async for o in it] == [1, 2]
    assert len(streams) == 0 and aborted == []


async def test_closed_output_stream_yields_nothing_more_and_aborts_nothing() -> None:
    aborted: list[str] = []
    streams: OutputStreams[str] = OutputStreams(aborted.append)
    it = streams.open("r")
    streams.put("r", StageOutput("r", 1))
    streams.close("r")
    streams.put("r", StageOutput("r", 2))
    assert [o async for o in it] == []
    assert aborted == []


async def test_leaving_an_output_stream_early_aborts_its_request() -> None:
    aborted: list[str] = []
    streams: OutputStreams[str] = OutputStreams(aborted.append)
    it = streams.open("r")
    streams.put("r", StageOutput("r", 1))
    async with contextlib.aclosing(it):
        async for _ in it:
            break
    assert aborted == ["r"] and "r" not in streams


async def test_output_stream_overflow_is_one_error_and_an_abort() -> None:
    aborted: list[str] = []
    streams: OutputStreams[str] = OutputStreams(aborted.append, limit=2)
    it = streams.open("r")
    for n in range(3):
        streams.put("r", StageOutput("r", n))
    outs = [o async for o in it]
    assert len(outs) == 1 and outs[0].finished and "overflow" in (outs[0].error or "")
    assert aborted == ["r"]


def test_a_key_streams_once_at_a_time() -> None:
    streams: OutputStreams[str] = OutputStreams(lambda key: None)
    streams.open("r")
    with pytest.raises(ValueError, match="already streaming"):
        streams.open("r")


class HoldingStage(CountingStage):
    """Holds each request back until `hold_s` after it came, and says when (`wake_in`)."""

    name = "hold"

    def __init__(self, hold_s: float) -> None:
        super().__init__()
        self.hold_s = hold_s
        self.due: float | None = None
        self.stepped = threading.Event()

    def add(self, request_id: str, inputs: Any) -> None:
        super().add(request_id, inputs)
        self.due = time.monotonic() + self.hold_s

    def has_work(self) -> bool:
        return bool(self.left) and self.due is not None and time.monotonic() >= self.due

    def wake_in(self) -> float | None:
        return None if not self.left or self.due is None else self.due - time.monotonic()

    def step(self) -> list[StageOutput]:
        self.stepped.set()
        return super().step()


def test_a_stage_holding_work_back_is_stepped_when_it_said_without_new_input() -> None:
    stage = HoldingStage(hold_s=0.2)
    core = EngineCore({"hold": stage})
    core.start()
    try:
        core.add("hold", "a", 1)
        # Nothing else reaches the engine: only the stage's own `wake_in` ends its sleep.
        assert stage.stepped.wait(timeout=10)
        wait_until_blocking(lambda: not core.pending()["hold"], 5, "the engine to drain")
    finally:
        core.shutdown()


def test_a_yielding_lane_runs_its_thread_and_the_threads_it_starts_below_the_others() -> None:
    from engine.runtime.lanes import EngineLanes

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def nice_of_a_thread_started_here() -> int:
        # What MLX's stream thread, started by the lane's first op, inherits.
        seen: list[int] = []
        started = threading.Thread(target=lambda: seen.append(nice()))
        started.start()
        started.join()
        return seen[0]

    lanes = EngineLanes(
        {"main": {"count": CountingStage()}, "small": {"other": CountingStage()}},
        yielding={"main": 3},
    )
    lanes.start()
    try:
        small = lanes.call("other", lambda _: nice()).result(timeout=10)
        main = lanes.call("count", lambda _: nice()).result(timeout=10)
        started = lanes.call("count", lambda _: nice_of_a_thread_started_here()).result(timeout=10)
    finally:
        lanes.shutdown()
    # Threads have a nice value of their own on Linux only; elsewhere nothing yields.
    assert main == started == (min(small + 3, 19) if sys.platform == "linux" else small)
