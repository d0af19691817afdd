"""Make MLX's Linux CPU backend use an optimised BLAS.

MLX's Linux wheel bundles the reference BLAS (~6 GFLOPS on a 2048² matmul). An
optimised library that exports the same unprefixed `cblas_sgemm`, loaded into the
global symbol scope *before* `mlx.core` is imported, wins symbol resolution and makes
every dense matmul and convolution ~30x faster. On macOS MLX uses Accelerate/Metal,
and with MLX's CUDA build on an NVIDIA GPU (`engine.runtime.device`) the GPU does the work:
nothing here applies. `engine.native.gemv_forward` goes in front of it, so that few-row
products (decode steps) read the weights once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

from engine.native import gemv_forward
from engine.runtime import device

log = logging.getLogger(__name__)

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
FIX = "apt-get install libopenblas0-pthread"
# After each call, OpenBLAS's worker threads spin (sched_yield) for 2**28 cycles, about a
# tenth of a second, before they sleep. The VAD runs a small product every few tens of
# milliseconds while any session streams, so the worker never slept: with 20 silent
# sessions it burned a whole core of two (gateway at 132% CPU, 37% with this). 2**4
# cycles, the least OpenBLAS takes, puts it to sleep at once; waking it costs
# microseconds per product. An operator's own setting wins.
SPIN_ENV, SPIN_LOG2_CYCLES = "OPENBLAS_THREAD_TIMEOUT", "4"
# A library path to load instead of the candidates, or "none" to keep the reference BLAS.
ENV = "DUPLEX_GATEWAY_BLAS"

_active: str | None = None
_checked = False


def ensure_fast_blas() -> str | None:
    """Load an optimised BLAS globally; return its path, or None (after one warning)."""
    global _active, _checked
    if _checked:
        return _active
    _checked = True
    if not sys.platform.startswith("linux"):
        return None
    if not device.uses_cpu_kernels():
        log.info("MLX computes on %s: no CPU BLAS to set up", device.accelerator())
        return None
    if "mlx.core" in sys.modules:
        log.warning(
            "mlx.core was imported before engine.native.blas; the BLAS cannot be swapped now"
        )
        return None
    override = os.environ.get(ENV)
    if override == "none":
        log.info("%s=none: MLX keeps its reference BLAS", ENV)
        return None
    # Read by OpenBLAS when it is loaded, so set before the first candidate is opened.
    os.environ.setdefault(SPIN_ENV, SPIN_LOG2_CYCLES)
    # An explicit path is the only candidate, so a wrong one is reported, not papered over.
    for path in [override] if override else CANDIDATES:
        if os.path.exists(path):
            try:
                # First in the global scope, so MLX's few-row products reach the forwarder.
                gemv_forward.load(path)
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                lib.cblas_sgemm  # noqa: B018 - raises AttributeError when absent
            except (OSError, AttributeError):
                continue
            _active = path
            return path
    log.warning(
        "No optimised BLAS found: MLX falls back to its reference BLAS, about 30x slower "
        "on every matmul and convolution. Fix: %s",
        FIX,
    )
    return None


def active_blas() -> str | None:
    """The path of the optimised BLAS loaded by `ensure_fast_blas`, or None."""
    return _active
