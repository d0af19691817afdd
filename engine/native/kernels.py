"""Build and load `native/kernels.c`: the CPU kernels of the voice's, Whisper's and
Smart Turn's encoder layers, each one call over NumPy arrays.

Why: at the Piper voice's widths (32 to 256 channels, up to 227,000 samples a second of
speech) MLX runs a conv as one small GEMM per tap plus a pass each for the activation,
the padding and the residual, and the passes cost more than the multiplications; and
MLX's CPU runs a layer norm, a GELU or a softmax as a chain of small passes, which cost
Piper's text encoder and Whisper's audio encoder about as much as their products. The
conv pads and activates its input once and keeps each output block's sums in registers
over every tap (see the C file); the norm (with the GELU after it), the GELU and the
softmax are one pass each, and so are Smart Turn's quantising steps (each rounded as
its MLX port rounds it). Smart Turn's integer codes are multiplied as 16-bit integers
where the CPU has AVX2 (`integer_products`): twice the products an instruction of the
float path, the same exact sums. The kernels work outside MLX's graph, so they serve the CPU
only: `engine.models.vits`, `engine.models.whisper` and `engine.models.smart_turn` use
them there and keep MLX's operations on a GPU, without a compiler, or with
`DUPLEX_GATEWAY_NATIVE_CONV=0`.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from engine.native import build

__all__ = [
    "ENV",
    "Conv",
    "conv1d",
    "gate",
    "gelu",
    "integer_products",
    "layer_norm",
    "load",
    "lookup",
    "matmul",
    "pack_strided_taps",
    "pack_taps",
    "padded_bias",
    "quant_softmax",
    "requantize",
    "resblocks",
    "softmax",
    "strided_conv1d",
]

SOURCE = Path(__file__).with_name("kernels.c")
ENV = "DUPLEX_GATEWAY_NATIVE_CONV"
# The kernel writes output channels in vectors of this many floats, two at a time.
LANES = 8
BLOCK = 2 * LANES

# Each kernel's return type and parameters, as "name:type" (p a pointer, l a long, i an
# int, f a float), in the C file's order.
_C_TYPES = {"p": ctypes.c_void_p, "l": ctypes.c_long, "i": ctypes.c_int, "f": ctypes.c_float}
_SIGNATURES: dict[str, tuple[type[ctypes.c_int] | None, str]] = {
    "native_conv": (
        ctypes.c_int,
        "x:p t_in:l ldx:l ci:i pad_left:l t_out:l taps:i dilation:i w:p co:i bias:p "
        "residual:p slope:f out:p",
    ),
    "native_int_conv": (
        ctypes.c_int,
        "x:p t_in:l ldx:l ci:i pad_left:l t_out:l taps:i dilation:i wi:p co:i bias:p "
        "residual:p out:p",
    ),
    "native_integer_products": (ctypes.c_int, ""),
    "native_resblocks": (
        ctypes.c_int,
        "x:p rows:l c:i blocks:i per_block:i pairs:i taps:p bias:p kernel:p dilation:p "
        "slope:f total:p work:p tmp:p",
    ),
    "native_gate": (None, "a:p rows:l h:i out:p"),
    "native_gelu": (None, "x:p n:l out:p"),
    "native_softmax": (None, "x:p rows:l n:l"),
    "native_layer_norm": (None, "x:p residual:p rows:l c:i gamma:p beta:p eps:f gelu:i out:p"),
    "native_requantize": (None, "x:p rows:l cols:i mult:p divide:i zero:f mode:i scale:f bias:p"),
    "native_lookup": (None, "levels:p rows:l cols:i table:p channels:i out:p"),
    "native_quant_softmax": (
        ctypes.c_int,
        "x:p rows:l n:l mult:f zero_in:f table:p unit:f zero_out:f",
    ),
}


_lib: ctypes.CDLL | None = None
_tried = False


def load() -> bool:
    """Build (once per CPU, into the engine cache) and load the kernel; True when it
    can be used. Safe to call again: the answer of the first call stands."""
    global _lib, _tried
    if _tried:
        return _lib is not None
    _tried = True
    if os.environ.get(ENV) == "0":
        return False
    built = build.library(
        SOURCE, "kernels", "the voice and Whisper's encoder keep MLX's operations"
    )
    if built is None:
        return False
    lib = ctypes.CDLL(str(built))
    for name, (restype, params) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = [_C_TYPES[param.split(":")[1]] for param in params.split()]
    _lib = lib
    return True


def integer_products() -> bool:
    """Whether `pack_taps(..., integers=True)` weights run here (AVX2's 16-bit
    multiply-adds); False also when the kernels are not loaded."""
    return _lib is not None and bool(_lib.native_integer_products())


def pack_taps(weight: np.ndarray, integers: bool = False) -> np.ndarray:
    """A conv weight stored as (out, taps, in) as the kernel reads it: the out channels
    padded with zeros to whole vectors, then cut in blocks of 16 (the last may be 8),
    each block's (taps, in, 16) weights in one run. Returned as (taps, in, padded out)
    in shape, for the checks; its bytes are the blocks. With `integers` (weights that
    are integers of 16 bits or fewer, an even number of inputs; see `integer_products`)
    as int16, each output channel's inputs in pairs: a block's (taps, in / 2, 16, 2)."""
    out_ch, n_taps, ci = weight.shape
    padded = -(-out_ch // LANES) * LANES
    dtype = np.int16 if integers else np.float32
    if integers and (ci % 2 or not np.array_equal(weight, weight.astype(dtype))):
        raise ValueError("integer taps take int16 values over an even number of inputs")
    full = np.zeros((padded, n_taps, ci), dtype)
    full[:out_ch] = weight
    units = full.view(np.int32) if integers else full  # a pair of 16-bit inputs: one unit
    whole = padded // BLOCK * BLOCK  # the blocks of 16, then the last 8 if any
    blocks = units[:whole].reshape(-1, BLOCK, n_taps, units.shape[2]).transpose(0, 2, 3, 1)
    last = units[whole:].transpose(1, 2, 0)
    packed = np.concatenate([blocks.reshape(-1), last.reshape(-1)])
    return packed.view(dtype).reshape(n_taps, ci, padded)


def pack_strided_taps(weight: np.ndarray, integers: bool = False) -> np.ndarray:
    """A 3-tap conv weight of stride 2 and padding 1 (out, 3, in) as the `pack_taps`
    weights of the undilated 2-tap conv that `strided_conv1d` runs over the rows' two
    phases side by side: output t = w0 x[2t - 1] + w1 x[2t] + w2 x[2t + 1], so two taps
    over the pairs [x[2t] | x[2t + 1]], the first seeing only the odd half."""
    out_ch, n_taps, ci = weight.shape
    if n_taps != 3:
        raise ValueError(f"a strided conv of 3 taps, not {n_taps}")
    phases = np.zeros((out_ch, 2, 2 * ci), np.float32)
    phases[:, 0, ci:] = weight[:, 0]
    phases[:, 1] = np.concatenate([weight[:, 1], weight[:, 2]], axis=1)
    return pack_taps(phases, integers)


def strided_conv1d(x: np.ndarray, taps: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """The conv of stride 2 and padding 1 over x (rows, in) whose weights
    `pack_strided_taps` packed, + bias: (ceil(rows / 2), padded out channels)."""
    rows, ci = x.shape
    t = (rows + 1) // 2
    pairs = np.zeros((t, 2 * ci), np.float32)
    pairs[:, :ci] = x[0::2]
    pairs[: rows // 2, ci:] = x[1::2]
    return conv1d(pairs, taps, length=t, pad_left=1, bias=bias)


def padded_bias(bias: np.ndarray, taps: np.ndarray) -> np.ndarray:
    """`bias` with zeros for the padded output channels of `pack_taps` weights."""
    out = np.zeros(taps.shape[2], np.float32)
    out[: len(bias)] = bias
    return out


def conv1d(
    x: np.ndarray,
    taps: np.ndarray,
    *,
    length: int,
    pad_left: int,
    dilation: int = 1,
    bias: np.ndarray | None = None,
    residual: np.ndarray | None = None,
    slope: float = 1.0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """`length` rows of bias + residual + conv(leaky_relu(x, slope)); slope 1 is no
    activation. x is (rows, in), read with `pad_left` zero rows before it and as many
    after as the taps need; `taps` comes from `pack_taps`; `bias` has the padded width.
    The result is (length, padded out channels): `out` if given, which may be
    `residual` itself (the conv then runs in place). x's rows may lie apart (a slice
    of a wider array's columns). Integer taps take x's values as int16 (truncated)
    and no activation."""
    lib = _loaded()
    n_taps, ci, co = taps.shape
    taps = np.ascontiguousarray(taps) if taps.dtype == np.int16 else _plain(taps)
    rows_apart = x.ndim == 2 and x.strides[1] == 4 and x.strides[0] >= 4 * x.shape[1]
    if x.dtype != np.float32 or not rows_apart or x.strides[0] % 4:
        x = _plain(x)
    if x.ndim != 2 or x.shape[1] != ci:
        raise ValueError(f"input {x.shape} does not have the taps' {ci} channels")
    if out is None:
        out = np.empty((length, co), np.float32)
    for name, a in (("bias", bias), ("residual", residual), ("out", out)):
        want = (co,) if name == "bias" else (length, co)
        if a is not None and (a.shape != want or a.dtype != np.float32 or not a.flags.c_contiguous):
            raise ValueError(f"{name} must be a contiguous float32 array of shape {want}")
    rows_of_x = (x.ctypes.data, x.shape[0], max(x.strides[0] // 4, ci), ci, pad_left, length)
    rest = (
        co,
        None if bias is None else bias.ctypes.data,
        None if residual is None else residual.ctypes.data,
    )
    if taps.dtype == np.int16 and slope != 1.0:
        raise ValueError("integer taps take no activation")
    if taps.dtype == np.int16:
        done = lib.native_int_conv(
            *rows_of_x, n_taps, dilation, taps.ctypes.data, *rest, out.ctypes.data
        )
    else:
        done = lib.native_conv(
            *rows_of_x, n_taps, dilation, taps.ctypes.data, *rest, slope, out.ctypes.data
        )
    if done != 0:
        raise ValueError("the native conv refused its arguments (or is out of memory)")
    return out


class Conv(NamedTuple):
    """One same-padded conv of a resblock: `pack_taps` weights, padded bias or None."""

    taps: np.ndarray
    bias: np.ndarray | None
    dilation: int


def resblocks(
    x: np.ndarray, blocks: list[list[Conv]], pairs: bool, slope: float, work: np.ndarray
) -> np.ndarray:
    """The mean over HiFi-GAN resblocks of each block over x (rows, c), in one call:
    kind "2" (pairs False) runs y = conv(act(y)) + y for each of a block's convs, kind
    "1" (pairs True) t = conv_a(act(y)), y = conv_b(act(t)) + y for each pair; act is
    the leaky ReLU of `slope`. `work` is (3, at least rows, c) of scratch; the result is
    its first plane."""
    lib = _loaded()
    x = _plain(x)
    rows, c = x.shape
    per_block = len(blocks[0])
    convs = [conv for block in blocks for conv in block]
    if any(len(b) != per_block for b in blocks) or (pairs and per_block % 2):
        raise ValueError("every block needs the same number of convs (in pairs for kind 1)")
    # The kernel keeps pointers to these: each must be the caller's own array, not a copy.
    biases = [conv.bias for conv in convs if conv.bias is not None]
    for a in [work, *(conv.taps for conv in convs), *biases]:
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError("work and the convs' weights must be contiguous float32 arrays")
    if any(conv.taps.shape[1:] != (c, c) for conv in convs) or any(b.shape != (c,) for b in biases):
        raise ValueError(f"a resblock's convs map {c} channels to {c}")
    if work.ndim != 3 or work.shape[0] < 3 or work.shape[1] < rows or work.shape[2] != c:
        raise ValueError(f"work must be of shape (3, >= {rows}, {c})")
    planes = [work[i, :rows] for i in range(3)]
    pointers = ctypes.c_void_p * len(convs)
    taps = pointers(*[conv.taps.ctypes.data for conv in convs])
    bias = pointers(*[None if conv.bias is None else conv.bias.ctypes.data for conv in convs])
    kernel = np.array([conv.taps.shape[0] for conv in convs], np.int32)
    dilation = np.array([conv.dilation for conv in convs], np.int32)
    done = lib.native_resblocks(
        x.ctypes.data,
        rows,
        c,
        len(blocks),
        per_block,
        int(pairs),
        taps,
        bias,
        kernel.ctypes.data,
        dilation.ctypes.data,
        slope,
        *(p.ctypes.data for p in planes),
    )
    if done != 0:
        raise ValueError("the native resblocks refused their arguments (or are out of memory)")
    return planes[0]


def gate(a: np.ndarray) -> np.ndarray:
    """WaveNet's gate of a (rows, 2h): tanh of the first h columns times the sigmoid of
    the last h, within 2e-7."""
    lib = _loaded()
    a = _plain(a)
    rows, width = a.shape
    if width % 2:
        raise ValueError(f"the gate takes an even number of columns, not {width}")
    out = np.empty((rows, width // 2), np.float32)
    lib.native_gate(a.ctypes.data, rows, width // 2, out.ctypes.data)
    return out


def matmul(a: np.ndarray, b: np.ndarray, integers: bool = False) -> np.ndarray:
    """a (rows, k) @ b (k, n) as a one-tap conv. NumPy's own BLAS keeps its threads
    spinning after a product unless told otherwise before it loads, and then holds a
    core the next step wants; these products share the conv's helpers. `integers`: both
    hold int16 values, k is even (`pack_taps`)."""
    taps = pack_taps(np.ascontiguousarray(b.T)[:, None, :], integers)
    y = conv1d(a, taps, length=a.shape[0], pad_left=0)
    return y if y.shape[1] == b.shape[1] else np.ascontiguousarray(y[:, : b.shape[1]])


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU of x, x Phi(x) (erf within 1.5e-7), as a new array."""
    lib = _loaded()
    x = _plain(x)
    out = np.empty_like(x)
    lib.native_gelu(x.ctypes.data, x.size, out.ctypes.data)
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    """x's rows (its last axis) replaced by their softmax, in place (e^x within 2 ulp);
    x must be a contiguous float32 array."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or not x.size:
        raise ValueError("the softmax works in place on a non-empty contiguous float32 array")
    _loaded().native_softmax(x.ctypes.data, x.size // x.shape[-1], x.shape[-1])
    return x


def layer_norm(
    x: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    residual: np.ndarray | None = None,
    gelu: bool = False,
    eps: float = 1e-5,
) -> np.ndarray:
    """Layer norm over the last axis of x + residual (rows, c), scaled by gamma and
    shifted by beta, then the exact GELU (erf within 1.5e-7) where `gelu`; a new array."""
    lib = _loaded()
    x = _plain(x)
    rows, c = x.shape
    gamma, beta = _plain(gamma), _plain(beta)
    if gamma.shape != (c,) or beta.shape != (c,):
        raise ValueError(f"gamma and beta must be of shape ({c},)")
    if residual is not None:
        residual = _plain(residual)
        if residual.shape != x.shape:
            raise ValueError(f"the residual must be of shape {x.shape}")
    out = np.empty_like(x)
    lib.native_layer_norm(
        x.ctypes.data,
        None if residual is None else residual.ctypes.data,
        rows,
        c,
        gamma.ctypes.data,
        beta.ctypes.data,
        eps,
        int(gelu),
        out.ctypes.data,
    )
    return out


# A float32 constant of a quantised graph, as NumPy or Python holds it.
Scalar = float | np.floating[Any]

# What `requantize` gives for each level: the level, its code, or its value.
Requantized = Literal["level", "code", "value"]
REQUANTIZED: dict[Requantized, int] = {"level": 0, "code": 1, "value": 2}


def requantize(
    x: np.ndarray,
    mult: np.ndarray | Scalar,
    zero: Scalar,
    *,
    divide: bool = False,
    out: Requantized = "level",
    scale: Scalar = 1.0,
    bias: np.ndarray | None = None,
) -> np.ndarray:
    """x (rows, cols), a contiguous float32 array, quantised in place as an ONNX
    QuantizeLinear does: the uint8 level round(x * mult) + zero, clipped to 0..255 (x /
    mult where `divide`), mult per column. `out` "level" keeps the level, "code" gives
    level - zero, "value" gives the code * scale (+ bias per column): a DequantizeLinear.
    One float32 rounding per operation, as the MLX port computes it."""
    cols = x.shape[-1]
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError("requantize works in place on a contiguous float32 array")
    mult = np.ascontiguousarray(np.broadcast_to(mult, (cols,)), np.float32)
    if bias is not None:
        bias = _plain(bias)
        if bias.shape != (cols,):
            raise ValueError(f"the bias must be of shape ({cols},)")
    _loaded().native_requantize(
        x.ctypes.data,
        x.size // cols,
        cols,
        mult.ctypes.data,
        int(divide),
        zero,
        REQUANTIZED[out],
        scale,
        None if bias is None else bias.ctypes.data,
    )
    return x


def lookup(levels: np.ndarray, table: np.ndarray) -> np.ndarray:
    """table[level, column] for each of the levels (rows, cols); the table is (256,
    cols), one column per column of levels, or (256, 1), one for all."""
    levels, table = _plain(levels), _plain(table)
    cols = levels.shape[-1]
    if table.shape not in ((256, cols), (256, 1)):
        raise ValueError(f"the table must be of shape (256, {cols}) or (256, 1)")
    if levels.size and not (levels.min() >= 0 and levels.max() <= 255):
        raise ValueError("levels run from 0 to 255")
    out = np.empty_like(levels)
    _loaded().native_lookup(
        levels.ctypes.data,
        levels.size // cols,
        cols,
        table.ctypes.data,
        table.shape[1],
        out.ctypes.data,
    )
    return out


def quant_softmax(
    x: np.ndarray, mult: Scalar, zero_in: Scalar, table: np.ndarray, unit: Scalar, zero_out: Scalar
) -> np.ndarray:
    """onnxruntime's QLinearSoftmax over the rows (last axis) of integer sums x, a
    contiguous float32 array, in place: their levels (x * mult, zero `zero_in`), e^ read
    from the 256-entry `table` shifted so that a row's largest level reads its last
    entry, summed in eight interleaved lanes as its AVX2 kernel does, scaled by `unit`
    (floor(1 / output scale)) over the sum: the output quantiser's codes (zero `zero_out`)."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or not x.size:
        raise ValueError("the softmax works in place on a non-empty contiguous float32 array")
    table = _plain(table)
    if table.shape != (256,):
        raise ValueError("the table has one entry per level: 256")
    n = x.shape[-1]
    done = _loaded().native_quant_softmax(
        x.ctypes.data, x.size // n, n, mult, zero_in, table.ctypes.data, unit, zero_out
    )
    if done != 0:
        raise ValueError(f"rows of {n} values: the lanes need a multiple of 8")
    return x


def _loaded() -> ctypes.CDLL:
    if _lib is None:
        raise RuntimeError("the native kernels are not loaded (kernels.load)")
    return _lib


def _plain(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)
