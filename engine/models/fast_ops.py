"""Elementwise functions, softmax and attention in the arithmetic MLX's CPU runs fast.

Why: on x86, MLX's CPU backend evaluates `exp`, `erf`, `tanh` and `sigmoid` one element
at a time through the C library (16 to 26 ns an element over a Whisper layer's 200 x 1536
activations), while multiply, add and divide run vectorized at well under 1 ns. So each
function here is built from arithmetic over one polynomial e^y of y <= 0, compiled
(`mx.compile`, shapeless) in short stages that MLX fuses into one loop each. GELU over
those activations takes about 1 ms instead of 8 (`bench/elementwise.py`).

e^y is computed as C libraries do: y = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor
polynomial, 2^n as 1 / (1 << -n). Below -30 ln 2 it is 0. The others follow from it:
sigmoid(x) = (1 + tanh(x / 2)) / 2, tanh(|x|) = (1 - e) / (1 + e) with e = e^-2|x|, erf by
Abramowitz and Stegun's 7.1.26 (for GELU). Errors against float64, as
`tests/test_fast_ops.py` asserts them: softmax weights relative 4e-7 (e^y's 3e-7 and a
division) above e^-20.7 of the row's largest, absolute 1e-9 below, and 0 under 2^-30;
`sigmoid`, `tanh` absolute 2e-7; `gelu` absolute 6e-7 (MLX's own `erf` is within 5e-7).

Without a C++ compiler MLX runs the stages unfused, with the same results. On a GPU each
function is MLX's own: Metal and CUDA have vectorized transcendentals.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask

__all__ = [
    "attention",
    "gelu",
    "sigmoid",
    "softmax",
    "tanh",
]

LOG2_E = 1.4426950408889634
# ln 2 in two parts, the first exact in few bits: n * LN2_HIGH has no rounding error.
LN2_HIGH = 0.693359375
LN2_LOW = -2.12194440e-4
# e^r = 1 + r + r^2 P(r) for |r| <= ln 2 / 2, P Taylor's: truncated within 2e-7.
EXP_P = (1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720)
# 2^-MAX_SHIFT is the smallest power of two that 1 << n can divide by in int32.
MAX_SHIFT = 30
EXP_FLOOR = -MAX_SHIFT * math.log(2.0) + 1e-4
# Abramowitz and Stegun 7.1.26: erf(x) = 1 - t P(t) e^-x^2, t = 1 / (1 + ERF_T x), x >= 0.
ERF_T = 0.3275911
ERF_P = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
SQRT_HALF = math.sqrt(0.5)

# How the functions are laid out for MLX's fuser and the C++ compiler behind it (g++ -O3
# for the baseline x86-64):
#   - Compiled shapeless, every binary op broadcasts its inputs, and the fuser follows a
#     chain at most 11 nodes deep: about five binary ops. A longer chain falls apart into
#     many small kernels. So e^y is computed in short stages, each one fused loop.
#   - A `where`, `maximum` or `minimum` becomes a branch the compiler does not vectorize
#     (and that mispredicts on random signs): the finishing stages take the sign by `sign`
#     and arithmetic instead, and only one stage clamps.
#   - Integer conversions and shifts inside a fused loop stop its vectorizing: the divisor
#     2^-n is three plain ops.
# e^y for y <= 0, from y clamped at EXP_FLOOR (`_scaled_abs`, `_scaled_square`, `_floored`:
# the only clamps):
#   _rounded: n, the nearest integer to y / ln 2;
#   _reduced: r = y - n ln 2 (|r| <= ln 2 / 2), in two parts;
#   _tail:    r^2 P(r), so that e^y = ((1 + r) + r^2 P(r)) / 2^-n;
#   _divisor: 2^-n, by an integer shift.
_compiled = partial(mx.compile, shapeless=True)


@_compiled
def _scaled_abs(x: mx.array, k: float) -> mx.array:
    return mx.maximum(mx.abs(x) * k, EXP_FLOOR)


@_compiled
def _scaled_square(x: mx.array, k: float) -> mx.array:
    return mx.maximum((x * x) * k, EXP_FLOOR)


@_compiled
def _floored(y: mx.array) -> mx.array:
    return mx.maximum(y, EXP_FLOOR)


@_compiled
def _rounded(y: mx.array) -> mx.array:
    # Truncating toward 0 rounds to nearest (y <= 0); MLX's CPU `floor` is per element.
    return (y * LOG2_E - 0.5).astype(mx.int32).astype(mx.float32)


@_compiled
def _reduced(y: mx.array, n: mx.array) -> mx.array:
    return (y - n * LN2_HIGH) - n * LN2_LOW


@_compiled
def _tail(r: mx.array) -> mx.array:
    """r^2 P(r) by Estrin's scheme, P = EXP_P: half as deep as Horner's rule."""
    c0, c1, c2, c3, c4 = EXP_P
    r2 = r * r
    r4 = r2 * r2
    return (r2 * (c0 + c1 * r) + r4 * (c2 + c3 * r)) + (r4 * r2) * c4


def _divisor(n: mx.array) -> mx.array:
    return mx.left_shift(1, (-n).astype(mx.int32)).astype(mx.float32)


def _exp_parts(y: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(r, r^2 P(r), 2^-n) of e^y, EXP_FLOOR <= y <= 0: e^y = ((1 + r) + r^2 P(r)) / 2^-n."""
    n = _rounded(y)
    r = _reduced(y, n)
    return r, _tail(r), _divisor(n)


@_compiled
def _exp_finish(y: mx.array, r: mx.array, tail: mx.array, divisor: mx.array) -> mx.array:
    e = ((1.0 + r) + tail) / divisor
    return mx.where(y < EXP_FLOOR, mx.zeros_like(e), e)


@_compiled
def _tanh_abs(r: mx.array, tail: mx.array, divisor: mx.array) -> mx.array:
    """(1 - e) / (1 + e) for e = e_r / divisor (= tanh(|x|) for e = e^-2|x|)."""
    e_r = (1.0 + r) + tail
    return (divisor - e_r) / (divisor + e_r)


@_compiled
def _sigmoid_finish(x: mx.array, t: mx.array) -> mx.array:
    # sigmoid(x) = (1 + tanh(x / 2)) / 2, t = tanh(|x| / 2).
    return 0.5 + (0.5 * mx.sign(x)) * t


@_compiled
def _signed(x: mx.array, t: mx.array) -> mx.array:
    return mx.sign(x) * t


@_compiled
def _erf_poly(a: mx.array) -> mx.array:
    """t P(t), t = 1 / (1 + ERF_T |x|): 1 - erf(|x|) = t P(t) e^-x^2."""
    c0, c1, c2, c3, c4 = ERF_P
    t = 1.0 / (1.0 + ERF_T * a)
    t2 = t * t
    t4 = t2 * t2
    return t * ((c0 + c1 * t) + t2 * (c2 + c3 * t) + t4 * c4)


@_compiled
def _gelu_finish(
    x: mx.array, poly: mx.array, r: mx.array, tail: mx.array, divisor: mx.array
) -> mx.array:
    # x (1 + erf(x / sqrt 2)) / 2; `rest` is 1 - erf(|x| / sqrt 2).
    rest = poly * (((1.0 + r) + tail) / divisor)
    return (0.5 * x) * (1.0 + mx.sign(x) * (1.0 - rest))


def _gelu(x: mx.array) -> mx.array:
    poly = _erf_poly(mx.abs(x) * SQRT_HALF)
    return _gelu_finish(x, poly, *_exp_parts(_scaled_square(x, -0.5)))


def _softmax(x: mx.array) -> mx.array:
    y = x - mx.max(x, axis=-1, keepdims=True)
    e = _exp_finish(y, *_exp_parts(_floored(y)))
    return e / mx.sum(e, axis=-1, keepdims=True)


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


# Elements per block: a stage's inputs and output stay in a core's cache between stages.
# A Whisper encoder's 30 s window has 13.5 M attention scores a layer, whose softmax in
# one piece would stream every stage through memory: slower than MLX's own. Arrays up to
# WHOLE elements (a 4 s window's 200 x 1536 activations) stay in cache whole, and go
# faster without the blocks' extra calls.
BLOCK = 1 << 16
WHOLE = 1 << 19


def _blockwise(fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """fn of x's rows (its last axis), over blocks of about BLOCK elements: each row's
    result is the same whatever the blocks. fn may change the rows' width."""
    if x.size <= WHOLE:
        return fn(x)
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    step = max(1, BLOCK // width)
    blocks = [fn(rows[i : i + step]) for i in range(0, rows.shape[0], step)]
    return mx.concatenate(blocks).reshape(*x.shape[:-1], -1)


def _tanh_of_abs(x: mx.array, k: float) -> mx.array:
    return _tanh_abs(*_exp_parts(_scaled_abs(x, k)))


def sigmoid(x: mx.array) -> mx.array:
    if not _on_cpu():
        return mx.sigmoid(x)
    return _blockwise(lambda b: _sigmoid_finish(b, _tanh_of_abs(b, -1.0)), x)


def tanh(x: mx.array) -> mx.array:
    if not _on_cpu():
        return mx.tanh(x)
    return _blockwise(lambda b: _signed(b, _tanh_of_abs(b, -2.0)), x)


def gelu(x: mx.array) -> mx.array:
    """The exact GELU, x Phi(x) (not the tanh approximation)."""
    if not _on_cpu():
        return nn.gelu(x)
    return _blockwise(_gelu, x)


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis."""
    if not _on_cpu():
        return mx.softmax(x, axis=-1, precise=True)
    return _blockwise(_softmax, x)


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: Any,
    softmax: Callable[[mx.array], mx.array] = softmax,
) -> mx.array:
    """q (B, heads, L, D) against k, v (B, kv_heads, S, D); mask None, "causal" or a boolean
    array broadcastable to (B, heads, L, S). Masked scores get a finite floor, so a padding
    row with every key masked stays finite. `softmax` takes the scores' last axis.

    Each key/value head meets its whole group of query heads in one product (`group x L`
    rows), so a decode step of B sequences makes B x kv_heads small products, not B x heads.
    """
    b, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scores = (q * scale).reshape(b, kv_heads, group * length, dim) @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = create_causal_mask(length, offset=keys - length)
    if mask is not None:
        scores = scores.reshape(b, kv_heads, group, length, keys)
        scores = mx.where(_grouped(mask, kv_heads, group), scores, mx.finfo(scores.dtype).min)
        scores = scores.reshape(b, kv_heads, group * length, keys)
    out = softmax(scores) @ v
    return out.reshape(b, heads, length, dim)


def _grouped(mask: mx.array, kv_heads: int, group: int) -> mx.array:
    """A (..., L, S) mask laid out to broadcast against (B, kv_heads, group, L, S)."""
    if mask.ndim < 4:
        return mask
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[-2:])
