"""Which device MLX computes on: Apple's GPU (Metal), an NVIDIA GPU (CUDA) or the CPU.

The engine tunes itself per device: on the CPU it puts OpenBLAS and the few-row
forwarder (`engine.native.blas`, `engine.native.gemv_forward`) under MLX and runs the LLM
in fp32; on a GPU those do nothing for MLX's kernels and 4-bit weights are faster. The
BLAS must be chosen before `mlx.core` is loaded, so the answer comes from the installed
packages, not from MLX.

On Linux `pip install -e .[cuda]` installs MLX's CUDA build (`mlx-cuda-12`) next to its
CPU build (`mlx-cpu`, a plain dependency); both ship `mlx/lib/libmlx.so`, and the one
written last is the one MLX loads. The file's size tells which, from each RECORD.
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import logging
import os
import sys
from typing import Literal

__all__ = ["Accelerator", "accelerator", "uses_cpu_kernels"]

log = logging.getLogger(__name__)

Accelerator = Literal["metal", "cuda", "cpu"]

CUDA_BUILDS = ("mlx-cuda-12", "mlx-cuda-13", "mlx-cuda")
LIBRARY = "mlx/lib/libmlx.so"
# Device nodes the NVIDIA driver makes, one per GPU (also inside GPU containers).
NVIDIA_DEVICES = "/dev/nvidia[0-9]*"


@functools.cache
def accelerator() -> Accelerator:
    """The device MLX uses by default in this process; found without importing MLX."""
    if sys.platform == "darwin":
        return "metal"
    build = _loaded_cuda_build()
    if build is None:
        return "cpu"
    if not _nvidia_gpu_present():
        log.warning("%s is installed but no NVIDIA GPU is visible: MLX runs on the CPU", build)
        return "cpu"
    return "cuda"


def uses_cpu_kernels() -> bool:
    """True when MLX computes on the CPU, where OpenBLAS and the forwarder pay off."""
    return accelerator() == "cpu"


def _loaded_cuda_build() -> str | None:
    """The MLX CUDA distribution whose library is the one on disk, if any."""
    for name in CUDA_BUILDS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if _owns_library(dist):
            return name
        log.warning(
            "%s is installed but MLX's library is another build's (the CPU one?), so MLX "
            "runs on the CPU. Fix: pip install --force-reinstall --no-deps %s==%s",
            name,
            name,
            dist.version,
        )
    return None


def _owns_library(dist: importlib.metadata.Distribution) -> bool:
    for f in dist.files or ():
        if f.as_posix() == LIBRARY:
            try:
                return os.path.getsize(str(f.locate())) == f.size
            except OSError:
                return False
    return False


def _nvidia_gpu_present() -> bool:
    return bool(glob.glob(NVIDIA_DEVICES))
