"""`exit_after`: a process that ran MLX on a worker thread leaves without C++ teardown
however its main ends, with the exit code that ending means."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import asyncio, sys
import engine
import mlx.core as mx
from engine.runtime.core import exit_after

def work():
    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
    mx.synchronize()

def main():
    asyncio.run(asyncio.to_thread(work))
    print("ran", flush=True)
    {ending}

exit_after(main)
"""


@pytest.mark.parametrize(
    ("ending", "code", "err"),
    [
        ("return None", 0, ""),
        ("return 3", 3, ""),
        ("sys.exit(0)", 0, ""),
        ("sys.exit('bad flag')", 1, "bad flag"),
        ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),
    ],
)
def test_every_ending_exits_with_its_code(ending: str, code: int, err: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(ending=ending)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stderr
    assert done.stdout == "ran\n"
    assert err in done.stderr and "terminate called" not in done.stderr
