"""Helpers shared by test modules: the real gateway in a subprocess, waiting for a
condition, and test audio. Test modules import from here, never from one another."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RATE = 24000  # the realtime API's PCM16 rate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GatewayProcess:
    """A `duplex-gateway` started through its CLI: its port, process and log lines."""

    port: int
    proc: subprocess.Popen
    lines: list[str]


@contextlib.contextmanager
def running_gateway(*args: str, env: dict[str, str] | None = None) -> Iterator[GatewayProcess]:
    """Start `duplex-gateway --port P *args` and stop it afterwards.

    It loads the embedded models: tests that use it are marked `models`.
    `DUPLEX_GATEWAY_API_KEY` from the outer environment is dropped so a test only gets
    the key it asks for.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "--port", str(port), "--log-level", "WARNING"]
    outer = {k: v for k, v in os.environ.items() if k != "DUPLEX_GATEWAY_API_KEY"}
    # The outer PYTHONPATH is kept behind the tree: a model package may be found there.
    path = os.pathsep.join(p for p in (str(ROOT), outer.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [*cmd, *args],
        cwd=ROOT,
        env={**outer, "PYTHONPATH": path, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 900  # a first run converts the models
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("gateway exited:\n" + "".join(lines[-40:]))
        lines.append(line)
        if "listening on" in line:
            break
    else:
        proc.kill()
        raise RuntimeError("gateway did not start:\n" + "".join(lines[-40:]))
    # Keep reading its log so a full pipe can never stall the server.
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        yield GatewayProcess(port, proc, lines)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Return once `condition()` holds; fail naming `what` after `timeout` seconds.

    For state with no event to await (counters owned by another thread or process). It
    proves that something happened; absence is proven by waiting for the thing that ends
    it (a drained engine, a closed stream), never by a quiet interval.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.005)


def tone_b64(ms: int, amp: float = 0.3) -> str:
    """`ms` of a 220 Hz tone as base64 PCM16 at 24 kHz, as `input_audio_buffer.append` takes."""
    t = np.arange(RATE * ms // 1000) / RATE
    pcm = (amp * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


def share_carriers(cache: Path) -> None:
    """Give a test's own model cache the weight carriers the shared cache already holds
    (`<cache>/wheels`), as hard links: nothing is downloaded again and the conversions'
    source fingerprints stay the same."""
    from engine.paths import cache_dir

    shared = cache_dir() / "wheels"
    if not shared.is_dir():
        return  # the carriers are installed packages here

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    skip = shutil.ignore_patterns(".download-*", ".tmp-*")
    shutil.copytree(shared, cache / "wheels", copy_function=link, ignore=skip, dirs_exist_ok=True)
