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
