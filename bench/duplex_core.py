"""Overhead of the duplex session core, with no model behind it.

Measures, over an in-process stage port that answers at once:

- `route_us`: microseconds `DuplexSession.route_output` spends per audio chunk;
- `manager_outputs_per_s`: stage outputs per second the manager's sink routes and queues;
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
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from duplex.contracts import (  # noqa: E402
    DuplexAppendPlan,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    DuplexStageSubmissionResult,
)
from duplex.events import TurnDone, TurnOutput  # noqa: E402
from duplex.manager import DuplexSessionHandle, DuplexSessionManager  # noqa: E402
from duplex.outputs import DuplexStageOutput, DuplexStreamingStagePort  # noqa: E402
from duplex.session import DuplexSession  # noqa: E402

PLAN = DuplexAppendPlan({"text": "hello"})
CHUNK = b"\x00\x01" * 960  # 40 ms of 24 kHz PCM16


class InstantPort(DuplexStreamingStagePort):
    """Accepts everything at once; the benchmark drives its outputs."""

    def __init__(self) -> None:
        self.sink: Callable[[DuplexStageOutput], None] | None = None
        self.aborted = 0

    @property
    def stage_count(self) -> int:
        return 3

    def sampling_defaults(self) -> tuple[object, ...]:
        return (None, None, None)

    def attach_output_sink(self, sink: Callable[[DuplexStageOutput], None]) -> None:
        self.sink = sink

    def ensure_request(self, context: DuplexStageRequestContext) -> None:
        return None

    async def submit(self, submission: DuplexStageSubmission) -> DuplexStageSubmissionResult:
        ctx = submission.context
        return DuplexStageSubmissionResult(ctx.request_id, ctx.stage_id, 0)

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += len(request_ids)

    async def cleanup(self, request_ids: list[str], *, abort: bool = False) -> None:
        return None


def audio_chunk(request_id: str) -> DuplexStageOutput:
    return DuplexStageOutput(request_id, 2, "audio", text="word ", audio=CHUNK, sample_rate=24000)


def bench_route(chunks: int) -> float:
    session = DuplexSession("bench", stage_count=3, sampling_defaults=(None,) * 3)
    session.open()
    steps = session.start_turn(PLAN, entry_stage_id=1, final_stage_id=2)
    tts = steps[1].context.request_id  # type: ignore[union-attr]
    outs = [audio_chunk(tts) for _ in range(chunks)]
    start = time.perf_counter()
    for out in outs:
        session.route_output(out)
    return (time.perf_counter() - start) / chunks * 1e6


async def bench_manager(turns: int, chunks_per_turn: int) -> dict[str, object]:
    port = InstantPort()
    manager = DuplexSessionManager(port, max_sessions=1, max_events=chunks_per_turn + 8)
    handle = manager.open("bench")
    done = asyncio.Event()
    seen: dict[str, int] = {"outputs": 0, "stale": 0}
    finished: set[int] = set()

    async def read() -> None:
        async for event in handle.events():
            if isinstance(event, TurnOutput):
                seen["outputs"] += 1
                seen["stale"] += event.turn_id in finished
            elif isinstance(event, TurnDone):
                finished.add(event.turn_id)
                done.set()

    reader = asyncio.create_task(read())
    to_done, to_aborted, emitted, busy = [], [], 0, 0.0
    for _ in range(turns):
        tts = await _start(handle, port)
        t0 = time.perf_counter()
        for _ in range(chunks_per_turn):
            port.sink(audio_chunk(tts))  # type: ignore[misc]
        await asyncio.sleep(0)
        busy += time.perf_counter() - t0
        emitted += chunks_per_turn
        done.clear()
        start = time.perf_counter()
        barge = asyncio.ensure_future(handle.barge_in())
        await done.wait()
        to_done.append((time.perf_counter() - start) * 1e6)
        await barge
        to_aborted.append((time.perf_counter() - start) * 1e6)
        port.sink(audio_chunk(tts))  # type: ignore[misc]  # a late chunk of the old turn
    await handle.close()
    await reader
    return {
        "manager_outputs_per_s": round(emitted / busy),
        "barge_in_to_done_us": _percentiles(to_done),
        "barge_in_to_aborted_us": _percentiles(to_aborted),
        "stale_after_done": seen["stale"],
        "dropped": dict(manager.dropped_outputs),
    }


async def _start(handle: DuplexSessionHandle, port: InstantPort) -> str:
    turn = await handle.start_turn(PLAN, entry_stage_id=1, final_stage_id=2)
    return next(r for r in handle.owned_request_ids if r.endswith(f"stage2-turn{turn}"))


async def bench_memory(sessions: int) -> int:
    port = InstantPort()
    manager = DuplexSessionManager(port, max_sessions=sessions)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    handles = [manager.open() for _ in range(sessions)]
    for handle in handles:
        await handle.start_turn(PLAN, entry_stage_id=1, final_stage_id=2)
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
