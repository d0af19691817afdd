"""Fixtures shared by the suites that run `duplex-gateway` for real, through its CLI."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_gateway(
    *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[int, list[str]]]:
    """Start `duplex-gateway --port P *args`; yield (port, its log lines); stop it after."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "--port", str(port), "--log-level", "WARNING"]
    proc = subprocess.Popen(
        [*cmd, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
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
        yield port, lines
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
