"""Input processing off the event loop: each session's jobs in order on a pool of
threads below the loop's priority, bounded, and nothing running after the lane closes."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect

from gateway.audio import ENGINE_RATE, Samples
from gateway.far_end import FarEnd
from gateway.input_lane import MAX_JOBS, InputLane, pool
from gateway.input_processing import InputProcessing, _Module
from gateway.priority import lower_this_thread
from tests.test_gateway_server import FakeBackend, recv, speech_b64, start_server, url
from tests.test_input_processing import CHUNK, Clock, recording, room


def numbered(n: int, log: list[int], gate: threading.Event | None = None) -> Samples:
    if gate is not None:
        gate.wait(10)
    log.append(n)
    return np.full(1, n, np.float32)


async def test_a_lanes_jobs_run_in_order_off_the_loop_and_are_announced() -> None:
    announced = asyncio.Event()
    lane = InputLane(pool(0), notify=announced.set)
    log: list[int] = []
    threads: set[int] = set()

    def job(n: int) -> Samples:
        threads.add(threading.get_ident())
        return numbered(n, log)

    futures = [lane.submit(lambda n=n: job(n)) for n in range(10)]
    results = [float((await asyncio.wrap_future(f))[0]) for f in futures]
    assert results == list(range(10)) and log == list(range(10))
    assert threading.get_ident() not in threads
    await asyncio.wait_for(announced.wait(), 10)
    await lane.aclose()


async def test_the_lane_is_bounded_and_closing_it_leaves_nothing_running() -> None:
    gate, started = threading.Event(), threading.Event()
    lane = InputLane(ThreadPoolExecutor(1), notify=lambda: None)
    log: list[int] = []

    def first() -> Samples:
        started.set()
        return numbered(0, log, gate)

    futures = [lane.submit(first)]
    futures += [lane.submit(lambda n=n: numbered(n, log, gate)) for n in range(1, MAX_JOBS)]
    room = asyncio.create_task(lane.room())
    assert await asyncio.to_thread(started.wait, 10)
    assert not room.done()  # MAX_JOBS wait or run, the first held at the gate: it waits
    closing = asyncio.create_task(lane.aclose())
    await asyncio.sleep(0)
    assert not closing.done()  # the running job is waited for
    gate.set()
    await asyncio.wait_for(closing, 10)
    # The first job had started: it finished; the others never ran.
    assert log == [0]
    assert futures[0].result()[0] == 0 and all(f.cancelled() for f in futures[1:])
    room.cancel()


async def test_a_lane_makes_room_as_jobs_finish() -> None:
    lane = InputLane(pool(0), notify=lambda: None)
    futures = [lane.submit(lambda: np.zeros(1, np.float32)) for _ in range(MAX_JOBS)]
    await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    await asyncio.wait_for(lane.room(), 10)
    await lane.aclose()


def test_a_pool_thread_runs_below_the_caller() -> None:
    executor = ThreadPoolExecutor(1, initializer=lower_this_thread, initargs=(3,))
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    theirs = executor.submit(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ).result()
    executor.shutdown()
    assert theirs == min(mine + 3, 19)


async def test_processing_on_a_lane_gives_what_it_gives_in_place() -> None:
    """The same echo through the same module, in place and on a lane: the same samples,
    in order; with jobs in flight, samples that pass on wait behind them."""
    far = np.tile(recording(), 2)[: 3 * ENGINE_RATE]
    mic = room(far, delay_ms=100, gain_db=-6)
    mic = np.concatenate([mic, 0.01 * np.ones(2 * ENGINE_RATE, np.float32)])  # echo dies

    async def run(lane: InputLane | None) -> tuple[Samples, int]:
        clock = Clock()
        far_end = FarEnd(clock)
        far_end.play("item_1", far, ENGINE_RATE)
        far_end.flush()
        settings = {"echo_cancellation": True, "noise_reduction": None, "start_ms": 0.0}
        if lane is None:
            processing = InputProcessing(far_end, **settings)  # type: ignore[arg-type]
        else:
            processing = InputProcessing(far_end, runner=lane.submit, **settings)  # type: ignore[arg-type]
        out, pushed = [], []
        for lo in range(0, len(mic), CHUNK):
            clock.ms += CHUNK / 16
            out.append(processing.push(mic[lo : lo + CHUNK]))
            pushed.append(len(out[-1]))
            await asyncio.sleep(0)
            out.append(processing.ready())
        out.append(processing.push(np.zeros(0, np.float32), last=True))
        return np.concatenate(out), min(pushed)

    in_place, _ = await run(None)
    lane = InputLane(ThreadPoolExecutor(1), notify=lambda: None)
    on_lane, least = await run(lane)
    await lane.aclose()
    assert len(on_lane) == len(mic)
    np.testing.assert_array_equal(on_lane, in_place)
    assert least == 0  # a push's output came later than the push (the warm-up's, at least)


async def test_the_gateway_cancels_echo_off_its_loop_and_hears_every_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A speaking session over a real socket: the module runs on the input-processing
    threads, never the loop's, and the backend hears every appended sample once."""
    ran_on: set[str] = set()
    run = _Module.run

    def recorded(module: _Module, plan: list[Any]) -> Samples:
        ran_on.add(threading.current_thread().name)
        return run(module, plan)

    monkeypatch.setattr(_Module, "run", recorded)
    backend = FakeBackend()
    server = await start_server(backend, echo_cancellation=True)
    try:
        async with connect(url(server)) as ws:
            await recv(ws, "session.created")
            update = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            await recv(ws, "session.updated")
            await ws.send(json.dumps({"type": "response.create"}))
            await recv(ws, "response.done")  # its audio plays: the far end
            for _ in range(25):  # 1 s while the echo may come back
                audio = speech_b64(40, loud=True)
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await recv(ws, "input_audio_buffer.committed")
        await asyncio.wait_for(backend.session_closed.wait(), 5)
    finally:
        await server.shutdown()
    assert ran_on and all(name.startswith("input-processing") for name in ran_on), ran_on
    assert backend.sessions[0].heard == ENGINE_RATE
