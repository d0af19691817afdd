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

Helpers shared by test modules live in `tests/helpers.py` (the real gateway, waiting for
a condition, test audio), `tests/fakes.py` (the fake stage port) and
`tests/fake_engine.py` (scripted fake engine stages and the orchestrator harness); test
modules never import from one another.
"""

from __future__ import annotations

import os
import sys

import pytest

# Collection is mostly pytest rewriting the test modules' asserts, and compiling the
# modules they import: two thirds of the quick subset's start. Both are cached next to
# the sources (`__pycache__/`, ignored by git) even where the environment asks Python
# not to write bytecode (PYTHONDONTWRITEBYTECODE), so a second run starts in a third
# of the time.
sys.dont_write_bytecode = False

import engine  # noqa: E402  (after the bytecode setting, so its modules are cached too)

# Test modules run models and tiny MLX models in this process: MLX gets the optimised
# BLAS, as in the gateway, before any of them imports it.
engine.setup()

_exit_status = 0


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    # `-n auto` (pyproject.toml) asks here. The quick subset (`-m "not models"`) runs on
    # two workers, in about half the time. A run with the model tests stays in this
    # process, one test at a time: several run a real-time client against a gateway
    # and must not share the cores with another model test.
    if "not models" in (config.getoption("markexpr") or ""):
        return min(2, os.cpu_count() or 1)
    return 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # Engine threads ran MLX in this process; MLX's static destructors at interpreter
    # exit can then abort it ("terminate called without an active exception"), turning
    # a passing run into exit code 134. Everything is reported by now, so leave without
    # them, as the gateway's own CLI does (`engine.runtime.core.exit_process`).
    from engine.runtime.core import exit_process

    exit_process(_exit_status)
