"""Build and load `native/llama_step.c`: a llama model's decode step in one native call.

Why: on a CPU, one decode step of a small model spends more time scheduling MLX
operations (some 1,400 for SmolLM2-135M) than computing them; the C step runs the same
arithmetic in one call, its weight products through the few-row forwarder's
`cblas_sgemm` (`engine.native.gemv_forward`: the compact twins, the helper threads).
It reads and extends the running batch's MLX KV cache (mlx-lm's `BatchKVCache`) in
place, so a step may run either way and the next one the other.

Results are within float rounding of MLX's step, not bit for bit: the norms' sums run in
another order and `expf` stands for MLX's `power(e, x)`. Each row is computed alone, so
a sequence's logits do not depend on the rows beside it. The step is used only where the
forwarder is active (its products are what make it fast) and a C compiler built it;
`DUPLEX_GATEWAY_NATIVE_STEP=0` keeps MLX's step.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.native import build, gemv_forward

__all__ = ["ENV", "LlamaShape", "LlamaStep", "load"]

SOURCE = Path(__file__).with_name("llama_step.c")
ENV = "DUPLEX_GATEWAY_NATIVE_STEP"
# Rotary factors are tabled for this many positions first, then twice as many as needed.
FIRST_POSITIONS = 1024

_lib: ctypes.CDLL | None = None


@dataclass(frozen=True)
class LlamaShape:
    """The sizes the step needs, in the C file's `shape` order, and the norms' epsilon."""

    layers: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    eps: float

    def sizes(self) -> list[int]:
        return [
            self.layers,
            self.dim,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.hidden,
            self.vocab,
        ]


# cos and sin (positions x head_dim) of positions 0..n-1, as the model's MLX step has them.
Angles = Callable[[int], tuple[mx.array, mx.array]]


@dataclass
class _Batch:
    """What the last step left in the cache; valid while the cache holds these arrays."""

    arrays: list[mx.array]  # each layer's keys and values
    offset: mx.array
    positions: list[int]  # each row's position for the next token
    first: list[int]  # each row's first position that is not padding
    idx: int
    pointers: ctypes.Array[ctypes.c_void_p]


class LlamaStep:
    """A decode step over a running `BatchKVCache` batch, computed by one C call."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        shape: LlamaShape,
        weights: Sequence[mx.array | None],
        angles: Angles,
    ) -> None:
        self._lib = lib
        self.shape = shape
        self._weights = list(weights)  # kept alive with their addresses
        sizes = shape.sizes()
        self._sizes = (ctypes.c_int * len(sizes))(*sizes)
        addresses = [None if w is None else _address(w) for w in self._weights]
        self._addresses = (ctypes.c_void_p * len(addresses))(*addresses)
        self._angles = angles
        self._cos = self._sin = np.zeros((0, shape.head_dim), np.float32)
        self._batch: _Batch | None = None

    def logits(self, tokens: Sequence[int], cache: Sequence[Any]) -> mx.array:
        """Each row's logits (rows x vocab) after its input token, whose key and value
        are appended to `cache` (one `BatchKVCache` per layer), as the model's own step
        would."""
        batch = self._current(cache)
        rows = len(tokens)
        if rows != len(batch.first):
            raise ValueError(f"{rows} tokens for a batch of {len(batch.first)} rows")
        cos, sin = self._rotations(batch.positions)
        logits = np.empty((rows, self.shape.vocab), np.float32)
        failed = self._lib.llama_step(
            self._sizes,
            ctypes.c_float(self.shape.eps),
            self._addresses,
            batch.pointers,
            rows,
            batch.arrays[0].shape[2],
            batch.idx,
            (ctypes.c_int * rows)(*tokens),
            (ctypes.c_int * rows)(*batch.first),
            cos.ctypes.data_as(ctypes.c_void_p),
            sin.ctypes.data_as(ctypes.c_void_p),
            logits.ctypes.data_as(ctypes.c_void_p),
        )
        if failed:
            raise MemoryError("no memory for a decode step")
        batch.positions = [p + 1 for p in batch.positions]
        batch.offset = mx.array(batch.positions)
        batch.idx += 1
        for layer in cache:
            layer.offset, layer._idx = batch.offset, batch.idx
        return mx.array(logits)

    def forget(self) -> None:
        """Let go of the batch the last step left (its cache arrays), once it is gone."""
        self._batch = None

    def _current(self, cache: Sequence[Any]) -> _Batch:
        """The batch as the cache holds it, with room for one more position in
        contiguous arrays; read again only when something else changed the cache."""
        last = self._batch
        if last is not None and _holds(cache, last):
            return last
        idx = cache[0]._idx
        _make_room(cache, idx)
        arrays = [a for layer in cache for a in (layer.keys, layer.values)]
        pointers = (ctypes.c_void_p * len(arrays))(*(_address(a) for a in arrays))
        offset, left_padding = cache[0].offset, cache[0].left_padding
        positions, first = offset.tolist(), left_padding.tolist()
        self._batch = _Batch(arrays, offset, positions, first, idx, pointers)
        return self._batch

    def _rotations(self, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each row's rotary factors, from the table (grown when a row outruns it)."""
        needed = max(positions) + 1
        if needed > len(self._cos):
            count = max(FIRST_POSITIONS, 2 * needed)
            self._cos, self._sin = (np.array(a, np.float32) for a in self._angles(count))
        return self._cos[positions], self._sin[positions]


def _holds(cache: Sequence[Any], batch: _Batch) -> bool:
    arrays = batch.arrays
    return all(
        layer._idx == batch.idx
        and layer.offset is batch.offset
        and layer.keys is arrays[2 * i]
        and layer.values is arrays[2 * i + 1]
        and layer.keys.shape[2] > batch.idx
        for i, layer in enumerate(cache)
    )


def _make_room(cache: Sequence[Any], idx: int) -> None:
    """Give every layer's keys and values a free position at `idx` in contiguous memory,
    growing them as `BatchKVCache.update_and_fetch` does (a step of positions at once)."""
    grown = []
    for layer in cache:
        fits = layer.keys.shape[2] > idx
        if fits and _contiguous(layer.keys) and _contiguous(layer.values):
            continue
        extra = layer.step if not fits else 0
        layer.keys, layer.values = (_extended(a, idx, extra) for a in (layer.keys, layer.values))
        grown += [layer.keys, layer.values]
    mx.eval(grown, [(layer.keys, layer.values) for layer in cache])


def _extended(a: mx.array, idx: int, extra: int) -> mx.array:
    """`a`'s first `idx` positions (axis 2) and room for the rest, as a new array."""
    kept = a[..., :idx, :]
    room = max(a.shape[2] - idx, 0) + extra
    zeros = mx.zeros((*a.shape[:2], room, a.shape[3]), a.dtype)
    return mx.concatenate([kept, zeros], axis=2)


def _contiguous(a: mx.array) -> bool:
    return bool(memoryview(a).c_contiguous)  # type: ignore[arg-type]


def _address(a: mx.array) -> int:
    return int(np.asarray(memoryview(a)).ctypes.data)  # type: ignore[arg-type]


def load(shape: LlamaShape, weights: Sequence[mx.array | None], angles: Angles) -> LlamaStep | None:
    """The native step for a model of `shape` whose weights (in the C file's order) are
    contiguous float32 arrays, or None: off by `ENV`, the forwarder inactive, weights it
    cannot read, or no compiler."""
    if os.environ.get(ENV) == "0" or not gemv_forward.is_active():
        return None
    if not all(w is None or _readable(w) for w in weights):
        return None
    lib = _library()
    return None if lib is None else LlamaStep(lib, shape, weights, angles)


def _readable(w: mx.array) -> bool:
    return w.dtype == mx.float32 and _contiguous(w)


def _library() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        built = build.library(SOURCE, "llama_step", "decode steps run as MLX operations")
        if built is None:
            return None
        _lib = ctypes.CDLL(str(built))
        _lib.llama_step.restype = ctypes.c_int
        _lib.llama_step.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
        _lib.llama_step.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _lib.llama_step.argtypes += [ctypes.c_void_p] * 5
    return _lib
