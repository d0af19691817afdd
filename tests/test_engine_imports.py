"""Importing the engine sets nothing up: no native build, no BLAS loaded, nothing written
to the cache. `engine.setup()` does that, once, when a process is about to run models.

Each check runs in a fresh interpreter: the test process has set the engine up already
(conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

IMPORT_ALL = """
    import importlib, json, os, pkgutil, sys
    import engine

    names = [m.name for m in pkgutil.walk_packages(engine.__path__, "engine.")]
    for name in names:
        importlib.import_module(name)
    maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
    mapped = {line.split()[5] for line in maps.splitlines() if len(line.split()) > 5}
    from engine.native import blas
    from engine.native import gemv_forward

    system_blas = {os.path.realpath(path) for path in blas.CANDIDATES if os.path.exists(path)}
    print(json.dumps({
        "modules": len(names),
        "openblas": bool(system_blas & {os.path.realpath(path) for path in mapped}),
        "forwarder": "gemv_forward-" in maps,
        "active": blas.active_blas(),
        "forwarding": gemv_forward.is_active(),
    }))
"""

SET_UP = """
    import json
    import engine

    path = engine.setup()
    import mlx.core as mx
    from engine.native import gemv_forward

    print(json.dumps({"path": path, "again": engine.setup(), "sum": mx.ones((4, 64)).sum().item(),
                      "forwarding": gemv_forward.is_active()}))
"""


def run_python(code: str, cache: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if cache is not None:
        env["DUPLEX_GATEWAY_CACHE"] = str(cache)
    env.pop("DUPLEX_GATEWAY_BLAS", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_every_engine_module_sets_nothing_up(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = run_python(IMPORT_ALL, cache)
    assert result["modules"] > 20
    assert result == {**result, "openblas": False, "forwarder": False, "active": None}
    assert not result["forwarding"]
    assert not cache.exists()  # nothing built, nothing written


def test_setup_puts_the_blas_under_mlx_once() -> None:
    result = run_python(SET_UP)  # the cache this test process set up: built already
    assert result["sum"] == 256.0
    assert result["again"] == result["path"]
    if sys.platform.startswith("linux"):
        assert result["path"] is not None, "install the Debian package libopenblas0-pthread"
        assert result["forwarding"]


CONSOLE_SCRIPT = """
    import json
    import gateway.cli as cli

    def main() -> int:
        from engine.native import blas

        print(json.dumps({"active": blas.ensure_fast_blas()}), flush=True)
        return 0

    cli.main = main
    cli.run()
"""


def test_the_console_script_sets_the_engine_up_before_mlx_loads() -> None:
    """`duplex-gateway` exits through `engine.runtime.core`, which imports MLX: the BLAS must be
    under MLX before that import, or every product runs on MLX's reference BLAS."""
    result = run_python(CONSOLE_SCRIPT)
    if sys.platform.startswith("linux"):
        assert result["active"] is not None, "install the Debian package libopenblas0-pthread"
