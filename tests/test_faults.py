"""Faults, with the real embedded models (SmolLM2, Whisper tiny.en, Piper joe, Silero VAD).

Most cases run the gateway in this process, on a thread with its own event loop, so the
test can look inside it: the engine thread's live requests, the orchestrator's running
turns, the server loop's asyncio tasks. The LLM stage is wrapped so that its next step
can be made to raise. Start-up failures and SIGTERM run the real CLI in a subprocess.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from duplex.manager import DuplexSessionManager
from engine.build import load_stages, warm_up
from engine.config import parse_config
from engine.pipeline.orchestrator import DuplexOrchestrator
from engine.runtime.core import AsyncEngine
from engine.runtime.lanes import EngineLanes
from engine.runtime.stage import Stage, StageOutput
from engine.weights.registry import cache_dir
from gateway.config import GatewayConfig, SessionLimits, load_profile
from gateway.server.server import GatewayServer
from gateway.session.engine_backend import EngineBackend
from tests.helpers import free_port, share_carriers, wait_until

pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "configs" / "default.yaml"
SLOW_QUEUE = 16
T = TypeVar("T")


class FaultyStage:
    """A real stage whose next step raises once `arm()` was called."""

    def __init__(self, stage: Stage) -> None:
        self._stage = stage
        self._armed = threading.Event()

    def arm(self) -> None:
        self._armed.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stage, name)

    def step(self) -> list[StageOutput]:
        if self._armed.is_set() and self._stage.has_work():
            self._armed.clear()
            raise RuntimeError("injected fault in the llm stage")
        return self._stage.step()


def _load_and_warm(config: Any) -> dict[str, Stage]:
    import mlx.core as mx

    try:
        stages = load_stages(config, progress=False)
        warm_up(stages)
        return stages
    finally:
        mx.synchronize()  # no MLX work left in flight on this worker thread


class InProcessGateway:
    """Two servers over one real engine: default limits, and a tiny send queue."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.run(self._build(), timeout=900)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def arun(self, fn: Callable[[], T]) -> T:
        """`fn()` on the server loop, awaited from the test's loop."""

        async def call() -> T:
            return fn()

        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(call(), self.loop)
        return await asyncio.wrap_future(future)

    async def _build(self) -> None:
        profile, _ = load_profile(PROFILE)
        config = parse_config(profile, source=str(PROFILE))
        stages = await asyncio.to_thread(_load_and_warm, config)
        self.llm = FaultyStage(stages["llm"])
        heavy: dict[str, Any] = {n: s for n, s in stages.items() if n not in ("vad", "llm")}
        # The same lanes as `build_engine`: VAD on a thread of its own.
        self.core = EngineLanes({"main": {**heavy, "llm": self.llm}, "vad": {"vad": stages["vad"]}})
        self.core.start()
        engine_ = AsyncEngine(self.core)
        self.orchestrator = DuplexOrchestrator(engine_, config)
        manager = DuplexSessionManager(self.orchestrator, max_sessions=64)

        async def stop_engine() -> None:
            await self.orchestrator.shutdown()
            await asyncio.to_thread(self.core.shutdown)

        self.backend = EngineBackend(manager, engine_, on_close=stop_engine)
        voices = (config.stages.tts.voice,)
        self.server = GatewayServer(GatewayConfig(port=0, voices=voices), self.backend)
        slow = GatewayConfig(
            port=0, voices=voices, limits=SessionLimits(send_queue_events=SLOW_QUEUE)
        )
        self.slow = GatewayServer(slow, self.backend)
        await self.server.start()
        await self.slow.start()
        # What runs for the gateway's whole life; any other task belongs to a session.
        self.startup_tasks = asyncio.all_tasks()

    def url(self, server: GatewayServer) -> str:
        return f"ws://127.0.0.1:{server.port}/v1/realtime"

    def snapshot(self) -> dict[str, Any]:
        """Called on the server loop: what the gateway and engine still hold."""
        pending = self.core.pending()
        tasks = asyncio.all_tasks(self.loop)
        this_call = {asyncio.current_task(self.loop)}
        return {
            "engine_requests": sum(pending.values()),
            "pending": pending,
            "turns": self.orchestrator.running_turns(),
            "reserved": self.orchestrator.reserved_requests(),
            "tasks": len(tasks),
            "session_tasks": len(tasks - self.startup_tasks - this_call),
            "connections": len(self.server.connections) + len(self.slow.connections),
        }

    def close(self) -> None:
        self.run(self.slow.shutdown())
        self.run(self.server.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def gw() -> Iterator[InProcessGateway]:
    gateway = InProcessGateway()
    try:
        yield gateway
    finally:
        gateway.close()


async def wait_for(
    gw: InProcessGateway, check: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    """Poll the gateway's snapshot until `check` holds; that snapshot."""
    snap: dict[str, Any] = {}

    async def holds() -> bool:
        snap.clear()
        snap.update(await gw.arun(gw.snapshot))
        return check(snap)

    await wait_until(holds, timeout, lambda: f"the gateway's state; last: {snap}", interval=0.02)
    return snap


def _nothing_running(snap: dict[str, Any]) -> bool:
    return snap["connections"] == 0 and snap["engine_requests"] == 0 and snap["session_tasks"] == 0


async def idle(gw: InProcessGateway) -> dict[str, Any]:
    """The snapshot once nothing is running: every session of earlier tests is released,
    down to the last task of its connection handler."""
    snap = await wait_for(gw, _nothing_running, 30)
    assert _nothing_running(snap), snap
    return snap


async def open_text_session(url: str, **kwargs: Any) -> ClientConnection:
    ws = await connect(url, max_size=None, **kwargs)
    assert json.loads(await ws.recv())["type"] == "session.created"
    update = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    await ws.send(json.dumps({"type": "session.update", "session": update}))
    return ws


async def ask(ws: ClientConnection, text: str, modalities: list[str], **response: Any) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    body = {"output_modalities": modalities, **response}
    await ws.send(json.dumps({"type": "response.create", "response": body}))


async def until(ws: ClientConnection, kinds: set[str], timeout: float = 120) -> list[dict]:
    events = []
    async with asyncio.timeout(timeout):
        while True:
            events.append(json.loads(await ws.recv()))
            if events[-1]["type"] in kinds:
                return events


# -- a client that disconnects mid-response --------------------------------------------


async def test_disconnect_mid_response_releases_every_request(gw: InProcessGateway) -> None:
    before = await idle(gw)
    ws = await open_text_session(gw.url(gw.server))
    await ask(ws, "Tell me a long story about a lighthouse keeper.", ["audio"])
    delta = (await until(ws, {"response.output_audio.delta"}))[-1]
    limit_ms = SessionLimits().output_chunk_ms  # the output chunk limit holds too
    assert len(base64.b64decode(delta["delta"])) <= limit_ms * 24000 * 2 // 1000
    busy = await gw.arun(gw.snapshot)
    assert busy["turns"] == 1 and busy["engine_requests"] >= 1, busy
    assert busy["session_tasks"] > 0, "the snapshot sees the session's tasks"
    ws.transport.abort()  # no close frame: the peer just vanishes
    snap = await wait_for(
        gw, lambda s: s["engine_requests"] == 0 and s["turns"] == 0 and s["reserved"] == 0, 5
    )
    assert snap["engine_requests"] == 0 and snap["turns"] == 0 and snap["reserved"] == 0, snap
    snap = await wait_for(gw, lambda s: s["tasks"] <= before["tasks"] and s["connections"] == 0, 10)
    assert snap["connections"] == 0
    assert snap["tasks"] <= before["tasks"], (before, snap)


async def test_many_disconnects_leak_no_task(gw: InProcessGateway) -> None:
    before = await idle(gw)
    for _ in range(5):
        ws = await open_text_session(gw.url(gw.server))
        await ask(ws, "Say something cheerful.", ["text"])
        await until(ws, {"response.output_text.delta", "response.done"})
        ws.transport.abort()
    snap = await wait_for(
        gw, lambda s: s["tasks"] <= before["tasks"] and s["engine_requests"] == 0, 15
    )
    assert snap["engine_requests"] == 0 and snap["turns"] == 0, snap
    assert snap["tasks"] <= before["tasks"], (before, snap)


# -- a stage that raises ---------------------------------------------------------------


async def test_stage_that_raises_fails_the_response_and_the_session_goes_on(
    gw: InProcessGateway,
) -> None:
    await idle(gw)
    ws = await open_text_session(gw.url(gw.server))
    gw.llm.arm()
    await ask(ws, "What is the capital of France?", ["text"])
    events = await until(ws, {"response.done"})
    done = events[-1]["response"]
    assert done["status"] == "failed", done
    assert "injected fault" in json.dumps(done["status_details"])
    errors = [e for e in events if e["type"] == "error"]

    await ask(ws, "What is the capital of France?", ["text"], max_output_tokens=12)
    after = await until(ws, {"response.done"})
    assert after[-1]["response"]["status"] in ("completed", "incomplete")
    text = "".join(e["delta"] for e in after if e["type"] == "response.output_text.delta")
    assert text.strip(), "the next turn answers"
    await ws.close()

    assert errors, "a failed response is announced with an `error` event"
    assert errors[0]["error"]["type"] == "server_error"
    assert "injected fault" in errors[0]["error"]["message"]


# -- a client that stops reading -------------------------------------------------------


async def test_client_that_stops_reading_is_closed_by_the_send_queue_bound(
    gw: InProcessGateway,
) -> None:
    await idle(gw)
    # A tiny receive window, and the client never calls recv(): the server's socket and
    # write buffer fill, then its bounded send queue.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", gw.slow.port))
    ws = await connect(gw.url(gw.slow), sock=sock, max_size=None, max_queue=4)
    await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
    item = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "Count slowly from one to forty."}],
    }
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create"}))
    for _ in range(3):  # out-of-band responses speak at the same time
        response = {"conversation": "none", "input": [item]}
        await ws.send(json.dumps({"type": "response.create", "response": response}))
    snap = await wait_for(gw, lambda s: s["connections"] == 0, 180)
    assert snap["connections"] == 0, "the server dropped the session that stopped reading"
    # Aborts land at the engine's next step; with four voices mid-synthesis on a busy
    # 2-core machine one step can take seconds.
    snap = await wait_for(gw, lambda s: s["engine_requests"] == 0 and s["turns"] == 0, 30)
    assert snap["engine_requests"] == 0 and snap["turns"] == 0, snap
    metrics = gw.server.metrics.render().decode() + gw.slow.metrics.render().decode()
    assert "duplex_gateway_send_queue_overflows_total 1.0" in metrics
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(30):
            while True:
                await ws.recv()
    assert ws.close_code in (1008, 1006, None)


# -- processes: start-up failures and SIGTERM ------------------------------------------


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", *args]
    # faulthandler prints every thread's stack if the process dies on a signal (SIGABRT).
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1", **(env or {})}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


def test_a_missing_model_stops_start_up_with_a_clear_message(tmp_path: Path) -> None:
    profile = yaml.safe_load(PROFILE.read_text())
    profile["stages"]["asr"]["model"] = "no-such-model"
    path = tmp_path / "missing.yaml"
    path.write_text(yaml.safe_dump(profile))
    proc = run_cli(["--port", str(free_port()), "--config", str(path)])
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "listening on" not in output
    assert "unknown model 'no-such-model'" in last_line(output)


def test_a_corrupt_model_cache_stops_start_up_with_a_clear_message(tmp_path: Path) -> None:
    source = cache_dir() / "whisper-tiny.en"
    broken = tmp_path / "cache" / "whisper-tiny.en"
    broken.mkdir(parents=True)
    for name in os.listdir(source):
        if name != "model.safetensors":
            shutil.copy(source / name, broken / name)
    (broken / "model.safetensors").write_bytes(b"\x07" * 4096)
    share_carriers(broken.parent)
    proc = run_cli(["--port", str(free_port())], env={"DUPLEX_GATEWAY_CACHE": str(broken.parent)})
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "listening on" not in output
    assert str(broken / "model.safetensors") in last_line(output)


def test_sigterm_in_the_middle_of_a_turn() -> None:
    port = free_port()
    proc = run_cli(["--port", str(port)])
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on" in line:
            break
    else:
        raise AssertionError("gateway exited:\n" + "".join(lines[-40:]))

    async def turn() -> int | None:
        ws = await open_text_session(f"ws://127.0.0.1:{port}/v1/realtime")
        await ask(ws, "Tell me a long story about a lighthouse keeper.", ["audio"])
        await until(ws, {"response.output_audio.delta"})
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed):
            # Past the profile's 30 s drain timeout: a busy session is closed by then.
            async with asyncio.timeout(120):
                while True:
                    await ws.recv()
        return ws.close_code

    try:
        code = asyncio.run(turn())
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    rest = proc.stdout.read()
    assert code == 1001, "the session is closed as `going away`"
    assert rc == 0, rest
    assert "Traceback" not in rest
