"""Shared test setup, and what the `models` marker means.

`models` (registered in pyproject.toml) marks each test that needs the real embedded
models, so that `pytest -m "not models"` is a fast inner loop; CI runs everything. A test
is marked when it:

- loads the weights of an embedded model (SmolLM2, Whisper tiny.en, Piper joe, Silero
  VAD), whether converted in the model cache (`registry.prepare`, `build_engine`) or read
  from its pip package (the GGUF, the ONNX voice and VAD files, run by onnxruntime);
- starts the real gateway (`running_gateway` and the CLI load all four models) or an
  `mlx_lm.server`;
- drives Chromium.

Not models: eSpeak NG's phoneme data (a system library that answers in milliseconds),
tiny random-weight models built inside a test, and listing the registry (it reads
package metadata, not weights).

Marks are explicit: `pytestmark = pytest.mark.models` in a module whose every test needs
models, `@pytest.mark.models` on the tests that do in a mixed module. No hook guesses
them from fixture names.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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

    `DUPLEX_GATEWAY_API_KEY` from the outer environment is dropped so a test only gets
    the key it asks for.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "--port", str(port), "--log-level", "WARNING"]
    outer = {k: v for k, v in os.environ.items() if k != "DUPLEX_GATEWAY_API_KEY"}
    proc = subprocess.Popen(
        [*cmd, *args],
        cwd=ROOT,
        env={**outer, "PYTHONPATH": str(ROOT), **(env or {})},
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
