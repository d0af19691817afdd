"""The gateway under a benchmark: `duplex-gateway` started through its CLI in a child
process, and a client that appends audio at a microphone's pace.

    with gateway_process("--config", "my.yaml", env={"OMP_NUM_THREADS": "1"}) as gw:
        async with connect(gw.realtime_url) as ws:
            await stream_audio(ws, pcm)
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RATE",
    "Gateway",
    "append_event",
    "gateway_process",
    "recv_until",
    "send_paced",
    "stream_audio",
]

ROOT = Path(__file__).resolve().parent.parent
RATE = 24000
# A first run converts the models before the port opens.
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0
LOG_LINES = 200


@dataclass
class Gateway:
    """A running `duplex-gateway`: where to reach it, its process, its latest log lines."""

    port: int
    proc: subprocess.Popen[str]
    log: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))

    @property
    def url(self) -> str:
        """The ws base URL, `ws://127.0.0.1:PORT/v1`."""
        return f"ws://127.0.0.1:{self.port}/v1"

    @property
    def realtime_url(self) -> str:
        return f"{self.url}/realtime"

    @property
    def pid(self) -> int:
        return self.proc.pid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gateway_process(
    *args: str, env: Mapping[str, str] | None = None, log_level: str = "WARNING"
) -> Iterator[Gateway]:
    """Run `duplex-gateway --port P --log-level L *args` until the block ends.

    `env` is laid over this process's environment. The block starts once the gateway
    listens (its models loaded); SIGTERM then stops it, as an operator would.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "--port", str(port), "--log-level", log_level]
    proc = subprocess.Popen(
        [*cmd, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    gateway = Gateway(port, proc)
    try:
        _wait_listening(gateway)
        # Keep reading the log so a full pipe can never stall the server.
        threading.Thread(target=gateway.log.extend, args=(proc.stdout,), daemon=True).start()
        yield gateway
    finally:
        _stop(proc)


def _wait_listening(gateway: Gateway) -> None:
    stdout = gateway.proc.stdout
    assert stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = stdout.readline()
        if not line:  # its output closed: the process is exiting
            code = gateway.proc.wait(STOP_TIMEOUT_S)
            raise RuntimeError(f"the gateway exited with {code} at start:\n" + "".join(gateway.log))
        gateway.log.append(line)
        if "listening on" in line:
            return
    raise RuntimeError("the gateway did not start:\n" + "".join(gateway.log))


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def recv_until(ws: Any, kind: str, timeout_s: float = 180.0) -> list[dict[str, Any]]:
    """The server's events up to and including the first of type `kind`; an `error`
    event raises."""
    events = []
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
        if event["type"] == "error":
            raise RuntimeError(f"the gateway refused an event: {event['error']}")
        events.append(event)
        if event["type"] == kind:
            return events


def append_event(pcm: bytes) -> str:
    """`input_audio_buffer.append` of PCM16 24 kHz mono, as sent on the wire."""
    audio = base64.b64encode(pcm).decode()
    return json.dumps({"type": "input_audio_buffer.append", "audio": audio})


async def send_paced(ws: Any, events: Iterable[str], chunk_ms: int) -> None:
    """Send one event per `chunk_ms`, on an absolute schedule: a late wake-up sends the
    events it owes at once, so the stream never drifts behind real time."""
    start = time.monotonic()
    for n, event in enumerate(events):
        await ws.send(event)
        await asyncio.sleep(max(0.0, start + (n + 1) * chunk_ms / 1000 - time.monotonic()))


async def stream_audio(ws: Any, pcm: bytes, chunk_ms: int = 100) -> None:
    """Append PCM16 24 kHz `pcm` in `chunk_ms` chunks at real-time pace, as a microphone
    would."""
    step = RATE * 2 * chunk_ms // 1000
    chunks = (append_event(pcm[i : i + step]) for i in range(0, len(pcm), step))
    await send_paced(ws, chunks, chunk_ms)
