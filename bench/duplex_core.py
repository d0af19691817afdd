"""Overhead of the duplex session core, with no model behind it.

Measures, over the tests' fake stage port (`tests/fakes.py`), which answers at once
and records nothing here:

- `route_us`: microseconds `DuplexSession.route_output` spends per audio chunk;
- `manager_outputs_per_s`: stage outputs per second the manager's sink routes and
  queues and the reader takes;
- `barge_in_to_done_us`: from `barge_in()` to the reader holding `TurnDone(cancelled)`
  (p50/p95), and `barge_in_to_aborted_us` until the port's abort has returned;
- `stale_after_done`: outputs of the cancelled turn the reader saw after its `TurnDone`
  (must be 0) while the port kept emitting them;
- `bytes_per_session`: memory of an open session with one active turn.

    python bench/duplex_core.py [--turns 200] [--chunks 20000] [--sessions 500]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from duplex.events import TurnDone, TurnOutput  # noqa: E402
from duplex.manager import DuplexSessionHandle, DuplexSessionManager  # noqa: E402
from duplex.outputs import DuplexStageOutput  # noqa: E402
from duplex.session import DuplexSession  # noqa: E402
from duplex.turn import Stage, TurnRequest  # noqa: E402
from tests.fakes import FakeStagePort  # noqa: E402

TURN = TurnRequest(final=Stage.TTS, text="hello")
PLAN = TURN.plan()
CHUNK_MS = 40


def audio_chunk(port: FakeStagePort, request_id: str) -> DuplexStageOutput:
    return port.output(request_id, "audio", "word ", audio_ms=CHUNK_MS)


def bench_route(chunks: int) -> float:
    session = DuplexSession("bench", stage_count=3, sampling_defaults=(None,) * 3)
    session.open()
    steps = session.start_turn(PLAN, entry_stage_id=1, final_stage_id=2)
    tts = steps[1].context.request_id  # type: ignore[union-attr]
    port = FakeStagePort(record=False)
    outs = [audio_chunk(port, tts) for _ in range(chunks)]
    start = time.perf_counter()
    for out in outs:
        session.route_output(out)
    return (time.perf_counter() - start) / chunks * 1e6


async def bench_manager(turns: int, chunks_per_turn: int) -> dict[str, object]:
    port = FakeStagePort(record=False)
    manager = DuplexSessionManager(port, max_sessions=1, max_events=chunks_per_turn + 8)
    handle = manager.open("bench")
    done, caught_up = asyncio.Event(), asyncio.Event()
    seen: dict[str, int] = {"outputs": 0, "stale": 0}
    finished: set[int] = set()

    async def read() -> None:
        async for event in handle.events():
            if isinstance(event, TurnOutput):
                seen["outputs"] += 1
                seen["stale"] += event.turn_id in finished
                if seen["outputs"] % chunks_per_turn == 0:
                    caught_up.set()
            elif isinstance(event, TurnDone):
                finished.add(event.turn_id)
                done.set()

    reader = asyncio.create_task(read())
    to_done, to_aborted, emitted, busy = [], [], 0, 0.0
    for _ in range(turns):
        tts = await _start(handle)
        chunks = [audio_chunk(port, tts) for _ in range(chunks_per_turn)]
        caught_up.clear()
        t0 = time.perf_counter()
        for chunk in chunks:
            port.emit(chunk)
        await caught_up.wait()
        busy += time.perf_counter() - t0
        emitted += chunks_per_turn
        done.clear()
        start = time.perf_counter()
        handle.barge_in()
        await done.wait()
        to_done.append((time.perf_counter() - start) * 1e6)
        await handle.settled()
        to_aborted.append((time.perf_counter() - start) * 1e6)
        port.emit(audio_chunk(port, tts))  # a late chunk of the old turn
    await handle.close()
    await reader
    return {
        "manager_outputs_per_s": round(emitted / busy),
        "barge_in_to_done_us": _percentiles(to_done),
        "barge_in_to_aborted_us": _percentiles(to_aborted),
        "stale_after_done": seen["stale"],
        "dropped": dict(manager.dropped_outputs),
    }


async def _start(handle: DuplexSessionHandle) -> str:
    turn = handle.start_turn(TURN)
    await handle.settled()
    return next(r for r in handle.owned_request_ids if r.endswith(f"stage2-turn{turn}"))


async def bench_memory(sessions: int) -> int:
    port = FakeStagePort(record=False)
    manager = DuplexSessionManager(port, max_sessions=sessions)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    handles = [manager.open() for _ in range(sessions)]
    for handle in handles:
        handle.start_turn(TURN)
        await handle.settled()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    await manager.close_all()
    return round(used / sessions)


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
    return {"p50": round(statistics.median(ordered), 1), "p95": round(p95, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--sessions", type=int, default=500)
    args = parser.parse_args()
    result: dict[str, object] = {"route_us": round(bench_route(args.chunks), 2)}
    result.update(asyncio.run(bench_manager(args.turns, 50)))
    result["bytes_per_session"] = asyncio.run(bench_memory(args.sessions))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
