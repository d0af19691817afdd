"""The engine swaps MLX's reference BLAS for an optimised one before MLX loads.

Each check runs in a fresh interpreter: the swap only works before `mlx.core` is
imported, and the pytest process may already have imported it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV = "DUPLEX_GATEWAY_BLAS"


def run_python(
    code: str, blas_env: str | None = None, spin_env: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name, value in ((ENV, blas_env), ("OPENBLAS_THREAD_TIMEOUT", spin_env)):
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


PROBE = """
    import ctypes, json, os
    import engine
    engine.setup()
    import mlx.core as mx
    from engine.native.blas import active_blas

    # Which mapped file does the process-wide `cblas_sgemm` symbol live in?
    try:
        addr = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:  # not in the global scope: only mlx's private copy exists
        addr = -1
    owner = None
    maps = open("/proc/self/maps").read().splitlines()
    for line in maps:
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= addr < hi and len(fields) > 5:
            owner = fields[5]
    mapped = sorted({f.split()[5] for f in maps if len(f.split()) > 5})
    a = mx.array([[1.0, 2.0], [3.0, 4.0]])
    print(json.dumps({
        "active": active_blas(),
        "active_real": os.path.realpath(active_blas()) if active_blas() else None,
        "sgemm_owner": owner,
        "mapped": mapped,
        "product": (a @ a).tolist(),
    }))
"""


def json_of(code: str, blas_env: str | None = None, spin_env: str | None = None) -> Any:
    """The JSON value `code` prints last, run in a fresh interpreter that must succeed."""
    out = run_python(code, blas_env, spin_env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def probe(blas_env: str | None = None) -> dict:
    return json_of(PROBE, blas_env)


def test_engine_loads_an_optimised_blas_into_the_process() -> None:
    result = probe()
    if not sys.platform.startswith("linux"):
        assert result["active"] is None  # macOS: MLX uses Accelerate/Metal untouched
        return
    assert result["active"] is not None, "install the Debian package libopenblas0-pthread"
    assert result["active_real"] in result["mapped"]
    # The global `cblas_sgemm` resolves to the optimised library (or the few-row
    # forwarder in front of it, see test_gemv_forward.py), not mlx's bundled one.
    owner = os.path.realpath(result["sgemm_owner"])
    assert owner == result["active_real"] or "gemv_forward-" in owner
    assert "mlx_cpu.libs" not in result["sgemm_owner"]


def test_reference_blas_is_kept_when_disabled() -> None:
    result = probe("none")
    assert result["active"] is None
    assert not any("openblas" in path for path in result["mapped"])
    assert result["product"] == [[7.0, 10.0], [15.0, 22.0]]


def test_missing_blas_warns_once_naming_the_package() -> None:
    code = """
        import engine
        engine.setup()
        import engine.native.blas
        import mlx.core as mx
        assert engine.native.blas.ensure_fast_blas() is None
        assert engine.native.blas.ensure_fast_blas() is None
        print(mx.ones((2, 2)).sum().item())
    """
    out = run_python(code, "/nonexistent/libblas.so.3")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("libopenblas0-pthread") == 1, out.stderr
    assert "slower" in out.stderr
    assert out.stdout.strip() == "4.0"


def test_mlx_matmul_matches_numpy_with_the_active_blas() -> None:
    code = """
        import json
        import engine
        engine.setup()
        import mlx.core as mx
        import numpy as np
        rng = np.random.default_rng(0)
        a = rng.standard_normal((300, 200)).astype(np.float32)
        b = rng.standard_normal((200, 100)).astype(np.float32)
        out = np.array(mx.array(a) @ mx.array(b))
        print(json.dumps(float(np.abs(out - a @ b).max())))
    """
    assert json_of(code) < 1e-3


IDLE_WORKER = """
    import json, os, resource, time
    import engine
    engine.setup()
    import mlx.core as mx

    # Products as small as the VAD's, a few tens of milliseconds apart, for one second.
    a = mx.random.normal((256, 256))
    mx.eval(a @ a)
    def cpu_s():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    start_cpu, start = cpu_s(), time.monotonic()
    while time.monotonic() - start < 1.0:
        mx.eval(a @ a)
        time.sleep(0.03)
    print(json.dumps({"cpu_s": cpu_s() - start_cpu, "wall_s": time.monotonic() - start,
                      "timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}))
"""


def test_blas_workers_sleep_between_small_products() -> None:
    """OpenBLAS's workers spin for a tenth of a second after each call by default, so
    products a few tens of ms apart (the VAD's, while sessions stream) kept one busy
    without end. The engine has them sleep at once: the process then uses a small
    fraction of a core, where the default spin takes about a whole one."""
    if not sys.platform.startswith("linux"):
        return  # no OpenBLAS is loaded elsewhere
    quiet = json_of(IDLE_WORKER)
    assert quiet["timeout"] == "4"
    spinning = json_of(IDLE_WORKER, spin_env="28")  # OpenBLAS's default
    assert spinning["timeout"] == "28"  # an operator's own setting wins
    assert quiet["cpu_s"] < 0.5 * quiet["wall_s"], quiet
    assert spinning["cpu_s"] > quiet["cpu_s"], (quiet, spinning)
