"""What silent sessions cost the event loop: N realtime cores, each fed a silent 20 ms
`input_audio_buffer.append` every 20 ms (as a microphone sends), each frame carried as
the gateway carries it (its backend session, the duplex session, the orchestrator's
resident request and its speech detection) into the real Silero VAD stage on its engine
thread, in one process: no sockets and no client harness, so the figures are the
gateway's own per-frame work.

    python -m bench.silent_loop [--sessions 100] [--seconds 15]   (from the repository root)

Prints one JSON object: frames per second, the loop thread's CPU (percent of a core, and
microseconds per frame), the other threads' CPU (the VAD stage), and how late a 50 ms
timer on the loop ran (p50/p99). Timer lag on a shared machine includes time the
process waited for a core: quote the load average with it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import time

import engine

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from duplex.manager import DuplexSessionManager  # noqa: E402
from engine.config import parse_config  # noqa: E402
from engine.pipeline.orchestrator import DuplexOrchestrator  # noqa: E402
from engine.runtime.core import AsyncEngine, EngineCore  # noqa: E402
from engine.stages.vad import SileroVad, VadStage  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.session.actions import ConfigureVad, Hear  # noqa: E402
from gateway.session.engine_backend import EngineBackendSession  # noqa: E402
from gateway.session.realtime import RealtimeSession  # noqa: E402

FRAME_S = 0.02
SILENT_FRAME = json.dumps(
    {"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(960)).decode()}
)
PROBE_S = 0.05


class Microphone:
    """One session's core and backend session, as `gateway.server.connection` joins them."""

    def __init__(self, core: RealtimeSession, session: EngineBackendSession) -> None:
        self.core, self.session = core, session
        self.frames = 0
        self.carry_out()

    def carry_out(self) -> None:
        for action in self.core.actions():
            if isinstance(action, Hear):
                self.session.hear(action.samples)
            elif isinstance(action, ConfigureVad):
                self.session.detect(action.settings, action.start_ms, action.pause_after_ms)
        self.core.events_to_send()
        self.session.take_events()

    async def stream(self, offset: float) -> None:
        start = time.monotonic() + offset
        while True:
            self.core.receive_text(SILENT_FRAME)
            self.carry_out()
            self.frames += 1
            await self.session.room()
            await asyncio.sleep(max(0.0, start + self.frames * FRAME_S - time.monotonic()))


async def timer_lag(lags: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + PROBE_S
        await asyncio.sleep(PROBE_S)
        lags.append((loop.time() - due) * 1000)


def thread_cpu(process: psutil.Process) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in process.threads()}


async def measure(sessions: int, seconds: float) -> dict[str, object]:
    core = EngineCore({"vad": VadStage(SileroVad.from_registry())})
    engine = AsyncEngine(core)
    core.start()
    config = GatewayConfig()
    manager = DuplexSessionManager(
        DuplexOrchestrator(engine, parse_config({}, source="defaults")), max_sessions=sessions
    )
    mics = [
        Microphone(
            RealtimeSession(config=config, model=config.model_name, beta=False),
            EngineBackendSession(manager.open(f"sess{i}"), config.turns),
        )
        for i in range(sessions)
    ]
    tasks = [asyncio.create_task(m.stream(i * FRAME_S / sessions)) for i, m in enumerate(mics)]
    await asyncio.sleep(3.0)  # every stream running before the window opens
    lags: list[float] = []
    tasks.append(asyncio.create_task(timer_lag(lags)))
    process = psutil.Process()
    threads_before, loop_before = thread_cpu(process), time.thread_time()
    frames_before, started = sum(m.frames for m in mics), time.monotonic()
    await asyncio.sleep(seconds)
    wall = time.monotonic() - started
    loop_cpu = time.thread_time() - loop_before
    frames = sum(m.frames for m in mics) - frames_before
    threads_after = thread_cpu(process)
    others = sum(
        cpu - threads_before.get(tid, 0.0)
        for tid, cpu in threads_after.items()
        if tid != process.pid
    )
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(m.session.close() for m in mics))
    await asyncio.to_thread(core.shutdown, 5.0)
    return {
        "sessions": sessions,
        "frames_per_s": round(frames / wall),
        "loop_cpu_percent": round(loop_cpu / wall * 100, 1),
        "loop_cpu_us_per_frame": round(loop_cpu / frames * 1e6, 1),
        "other_threads_cpu_percent": round(others / wall * 100, 1),
        "timer_lag_ms_p50": round(float(np.percentile(lags, 50)), 1),
        "timer_lag_ms_p99": round(float(np.percentile(lags, 99)), 1),
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.sessions, args.seconds))))


if __name__ == "__main__":
    main()
