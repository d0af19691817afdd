"""Build and load `native/gemv_forward.c`: few-row matrix products that read the
weights once.

Why: one decode step of a few sequences multiplies a few rows by every weight matrix,
and OpenBLAS's sgemm packs each whole matrix before multiplying it; the forwarder's
kernels stream it once, in place, and skip the library's set-up on the many tiny
attention products (see the C file). The library is compiled once for this CPU with the
system's C compiler into the engine cache and must be loaded before the BLAS itself
(`engine.native.blas` does both). Without a compiler, or with `DUPLEX_GATEWAY_GEMV_FORWARD=0`,
nothing changes: MLX calls the BLAS's sgemm directly.

`compress` gives the weight matrices of a loaded model compact twins where their values
are exactly groups of 4-bit or 8-bit integers times a scale (a model dequantized from
GGUF, such as the embedded LLM): few-row products then read about a fifth (4-bit) or a
third (8-bit) of the bytes, scales included. Over 4-bit twins (and 8-bit ones with
AVX-512 VNNI) they run in integers against activations rounded to 8 bits per group of
32, as llama.cpp's do (results within a stated tolerance, each row's its own);
`exact_twins(True)` or `DUPLEX_GATEWAY_EXACT_TWINS=1` rebuilds the fp32 weights in
registers instead, bit for bit the fp32 product. A matrix whose values are all halves
(a model stored in float16, such as Whisper) gets a 16-bit twin: half the bytes, rebuilt
exactly, the fp32 product bit for bit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from engine.native import build

if TYPE_CHECKING:  # this module is imported before mlx.core (engine.native.blas)
    import mlx.core as mx
    import mlx.nn as nn

__all__ = [
    "ENV",
    "EXACT_ENV",
    "GROUPS_FILE",
    "compress",
    "enable",
    "exact_twins",
    "is_active",
    "live_twins",
    "load",
    "load_groups",
    "twin",
    "twin_groups",
    "twin_products",
    "use_twins",
]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv_forward.c")
ENV = "DUPLEX_GATEWAY_GEMV_FORWARD"
# Beside a converted model's weights: 4-bit groups its converter kept for their twins.
GROUPS_FILE = "twins.safetensors"
# "1": products over twins rebuild the weights in floats (bit for bit the fp32 product)
# instead of running in integers over rounded activations (`exact_twins`).
EXACT_ENV = "DUPLEX_GATEWAY_EXACT_TWINS"

_lib: ctypes.CDLL | None = None


def load(blas_path: str) -> bool:
    """Load the forwarder into the global symbol scope, bound to the BLAS at
    `blas_path`; call before that BLAS is loaded globally. True when active."""
    global _lib
    if _lib is not None:
        return True
    if os.environ.get(ENV) == "0":
        return False
    built = _built()
    if built is None:
        return False
    # Bound first, in the local scope: until it knows the BLAS's routines its
    # cblas_sgemm has nothing to forward to, so it must not answer MLX's calls.
    lib = ctypes.CDLL(str(built))
    lib.gemv_forward_twin_products.restype = ctypes.c_long
    if not lib.gemv_forward_bind(blas_path.encode()):
        log.warning("%s lacks cblas_sgemv or cblas_sgemm; few-row products use sgemm", blas_path)
        return False
    ctypes.CDLL(str(built), mode=ctypes.RTLD_GLOBAL)  # the same library, now global
    _lib = lib
    exact_twins(os.environ.get(EXACT_ENV) == "1")
    return True


def is_active() -> bool:
    return _lib is not None


def enable(on: bool) -> bool:
    """Turn forwarding on or off at run time (for side-by-side timing); returns the
    previous setting. Raises RuntimeError when the forwarder is not loaded."""
    if _lib is None:
        raise RuntimeError("the few-row forwarder is not loaded")
    return bool(_lib.gemv_forward_enable(int(on)))


def twin(weight: mx.array) -> int | None:
    """Give the fp32 matrix `weight` a compact twin; returns its bits per weight: 4 or 8
    (exact groups of such integers times a scale), or 16 (every value a half). None when
    it has no such form or the forwarder is off. The twin is found by the matrix's
    address, so it goes when `weight` does."""
    import numpy as np

    address = _matrix_address(weight)
    if _lib is None or address is None:
        return None
    rows, cols = weight.shape
    for bits in (4, 8):
        made = _lib.gemv_forward_twin(address, rows, cols, bits)
        if made != 0:
            return bits if _kept(weight, address, made) else None
    halves = np.ascontiguousarray(np.asarray(weight).astype(np.float16))
    made = _lib.gemv_forward_twin_halves(address, rows, cols, ctypes.c_void_p(halves.ctypes.data))
    return 16 if _kept(weight, address, made) else None


def twin_groups(weight: mx.array, q: mx.array, scales: mx.array, offsets: mx.array) -> bool:
    """Give the fp32 matrix `weight` (n x k) a 4-bit twin from given groups of 32: `q`
    (n x k/2 bytes, a group's byte j holding values j and j + 16 in its low and high
    nibble), `scales` and `offsets` (n x k/32), as a GGUF file's blocks hold them. True
    when made: every value must be exactly q * scale + offset."""
    import numpy as np

    address = _matrix_address(weight)
    if _lib is None or address is None:
        return False
    rows, cols = weight.shape
    arrays = [np.ascontiguousarray(np.asarray(a)) for a in (q, scales, offsets)]
    shapes = [(rows, cols // 2), (rows, cols // 32), (rows, cols // 32)]
    types = [np.uint8, np.float32, np.float32]
    if any(a.shape != s or a.dtype != t for a, s, t in zip(arrays, shapes, types, strict=True)):
        return False
    pointers = [ctypes.c_void_p(a.ctypes.data) for a in arrays]
    return _kept(weight, address, _lib.gemv_forward_twin_groups(address, rows, cols, *pointers))


def _matrix_address(weight: mx.array) -> ctypes.c_void_p | None:
    """The address sgemm gets for `weight` (MLX's buffer), if it can have a twin: a
    contiguous fp32 matrix whose rows are whole groups of 32."""
    import mlx.core as mx
    import numpy as np

    if weight.ndim != 2 or weight.shape[1] % 32 or weight.dtype != mx.float32:
        return None
    view = np.asarray(memoryview(cast(Any, weight)))
    return ctypes.c_void_p(view.ctypes.data) if view.flags.c_contiguous else None


def _kept(weight: mx.array, address: ctypes.c_void_p, made: int) -> bool:
    """Whether a twin was made (1); a made twin goes before `weight`'s buffer can hold
    other numbers."""
    assert _lib is not None
    if made == 1:
        weakref.finalize(weight, _lib.gemv_forward_untwin, address)
    elif made < 0:
        log.warning("no room for more compact weights: the rest stay fp32")
    return made == 1


def load_groups(folder: str | Path) -> dict[str, mx.array]:
    """The 4-bit groups a converter wrote beside a model's weights (`GROUPS_FILE`):
    `{module}.twin_q`, `.twin_scales` and `.twin_offsets` per matrix; {} without the file."""
    import mlx.core as mx

    path = Path(folder) / GROUPS_FILE
    return cast(dict[str, "mx.array"], mx.load(str(path))) if path.exists() else {}


def compress(model: nn.Module, groups: dict[str, mx.array] | None = None) -> dict[int, int]:
    """Twin every fp32 matrix of `model`: from its given 4-bit `groups` (`load_groups`,
    keyed by module) where it has them, otherwise where it has an exact compact form
    (`twin`); returns how many got each width."""
    from mlx.utils import tree_flatten

    groups = groups or {}
    made: dict[int, int] = {}
    leaves = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    for name, weight in leaves:
        module = name.removesuffix(".weight")
        given = [groups.get(f"{module}.twin_{part}") for part in ("q", "scales", "offsets")]
        if name.endswith(".weight") and all(a is not None for a in given):
            bits: int | None = 4 if twin_groups(weight, *cast(list[Any], given)) else None
        else:
            bits = twin(weight)
        if bits is not None:
            made[bits] = made.get(bits, 0) + 1
    return made


def use_twins(on: bool) -> bool:
    """Read the twins or leave them unread (for side-by-side timing); returns the
    previous setting. Raises RuntimeError when the forwarder is not loaded."""
    if _lib is None:
        raise RuntimeError("the few-row forwarder is not loaded")
    return bool(_lib.gemv_forward_use_twins(int(on)))


def exact_twins(on: bool) -> bool:
    """Products over twins in floats, bit for bit the fp32 product (True), or, where
    the CPU makes them faster (4-bit twins; 8-bit with AVX-512 VNNI), in integers over
    8-bit rounded activations, the default (False); returns the previous setting.
    Raises RuntimeError when the forwarder is not loaded."""
    if _lib is None:
        raise RuntimeError("the few-row forwarder is not loaded")
    return bool(_lib.gemv_forward_exact_twins(int(on)))


def live_twins() -> int:
    """How many matrices have a twin now."""
    return int(_lib.gemv_forward_live_twins()) if _lib is not None else 0


def twin_products() -> int:
    """How many products have read a twin in this process (0 when the forwarder is off)."""
    return int(_lib.gemv_forward_twin_products()) if _lib is not None else 0


def _built() -> Path | None:
    """The compiled library of `SOURCE` in the cache, built now if needed; None without
    a compiler (`engine.native.build`)."""
    return build.library(SOURCE, "gemv_forward", "few-row products use the BLAS's sgemm")
