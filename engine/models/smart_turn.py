"""Smart Turn v3.2 on MLX: does the speech so far sound like a finished turn?

The model (pipecat's BSD-2-Clause `smart-turn-v3.2-cpu.onnx`) reads the last 8 s of
16 kHz audio as 80 x 800 Whisper log-mel features, runs a Whisper-tiny-sized encoder,
pools its 400 frames with a learned attention and gives the probability that the turn is
complete.

The published file is statically quantised: int8 weights, and every activation passes a
uint8 quantise/dequantise pair with calibrated scales. The MLX model passes the integer
codes from layer to layer (`FakeQuant`) and computes each step as onnxruntime's fused
graph does: exact integer sums with one float multiplier (QLinearMatMul, QLinearConv,
QGemm), its QLinearSoftmax's exp() table, eight-lane sum and floor(1/scale), and its
Erf kernel's polynomial (MLAS, FMA3) for GELU. tests/test_smart_turn.py checks the
softmax and erf against onnxruntime bit for bit, and on speech every quantised tensor
of the first encoder layer comes out identical.

Speed: a quantised tensor has only 256 values (per channel where a float bias follows),
so GELU and exp() are not computed per element but read from tables built once at load
(`Lookup`, `QuantSoftmax`), which on MLX's CPU backend is several times faster than its
erf and exp. On the CPU the encoder runs item by item through the native kernels
(`engine.native.kernels`): the same float32 operations one pass each (quantising,
requantising, the softmax from its table and its lanes, the lookups) and the integer
sums through the conv kernel, in about half MLX's time (`bench/smart_turn.py`); the
pooling head stays on MLX. Without a compiler, or with `DUPLEX_GATEWAY_NATIVE_CONV=0`,
MLX's operations run it all.

What still differs is LayerNormalization: onnxruntime's float kernel rounds a last bit
differently in about half its outputs (its order of summation and operations is not
reproduced here; plain sequential float, float64 and lane-wise variants were tried and
none is bit-exact). Now and then such a bit moves a value across a rounding step of the
quantiser after it, and 16 quantised layers amplify that. onnxruntime disagrees with
itself in the same way: on the 20 test clips its unoptimised graph differed from its
fused one by about 0.06 on average with the release this port was built against, and
this model from the fused one by about 0.04-0.05. Release 1.32's fused int8 kernels
moved further (0.15 from its own
unoptimised graph, which this model now follows: 0.06 from it, 19 of 20 decisions the
same); tests/test_smart_turn.py measures all three. The pooling head's tanh, softmax and
sigmoid and the classifier's two GELUs use MLX's own functions. `convert` reads the ONNX
initializers with the `onnx` package; nothing of pipecat's own code or dependencies is
needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.models.whisper import (
    HOP_LENGTH,
    N_FFT,
    SAMPLE_RATE,
    _hann,
    _layer_norm,
    mel_filters,
)
from engine.native import kernels

__all__ = [
    "CONVERTER_VERSION",
    "N_FRAMES",
    "WINDOW_SAMPLES",
    "Model",
    "convert",
    "features",
    "find_onnx",
    "load",
]

CONVERTER_VERSION = "1"
ONNX_RELATIVE = Path("audio") / "turn" / "smart_turn" / "data" / "smart-turn-v3.2-cpu.onnx"
WINDOW_SAMPLES = 8 * SAMPLE_RATE
N_FRAMES = WINDOW_SAMPLES // HOP_LENGTH  # 800
N_MELS = 80
D_MODEL = 384
N_HEADS = 6
N_LAYERS = 4
POOL_HIDDEN = 256
HEAD_HIDDEN = (256, 64)


# --- features: what pipecat computes before calling the ONNX model ---


def features(audio: np.ndarray) -> np.ndarray:
    """(800, 80) log-mel frames of the last 8 s of `audio` (16 kHz float), zero-padded in
    front; the frames-major transpose of pipecat's `(80, 800)` input.

    Differs from Whisper's own front end (`whisper.log_mel_spectrogram`) in three ways
    the model was trained with: the 8 s window is normalised to zero mean and unit
    variance first, the spectrogram is centred with reflection at both ends of the
    window (not followed by silence), and the last of its 801 frames is dropped.
    """
    x = np.asarray(audio, np.float32)[-WINDOW_SAMPLES:]
    x = np.pad(x, (WINDOW_SAMPLES - len(x), 0))
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH]
    power = np.abs(np.fft.rfft(frames * _hann(N_FFT).astype(np.float64), axis=-1)) ** 2
    mel = np.einsum("tk,mk->tm", power, mel_filters(N_MELS).astype(np.float64))
    log_spec = np.log10(np.maximum(mel, 1e-10))[:-1]
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


# --- model ---


class FakeQuant(nn.Module):
    """A uint8 quantise/dequantise pair: ONNX QuantizeLinear then DequantizeLinear.

    The model passes the integers between layers: `codes_of` quantises a float tensor
    to its codes (uint8 level minus the zero point), `dequantize_codes` gives back the
    float value DequantizeLinear would.
    """

    def __init__(self) -> None:
        super().__init__()
        self.scale = mx.ones((1,))
        self.zero_point = mx.zeros((1,))

    def level(self, scaled: mx.array) -> mx.array:
        """The uint8 level (0..255, zero point included) of values already divided by
        this quantiser's scale."""
        return mx.clip(mx.round(scaled) + self.zero_point, 0, 255)

    def dequantize(self, level: mx.array) -> mx.array:
        return (level - self.zero_point) * self.scale

    def codes_of(self, x: mx.array) -> mx.array:
        return self.level(x / self.scale) - self.zero_point

    def dequantize_codes(self, codes: mx.array) -> mx.array:
        return codes * self.scale

    def constants(self) -> tuple[np.float32, np.float32]:
        """(scale, zero point) as float32 numbers, for the native kernels."""
        return np.float32(np.array(self.scale)[0]), np.float32(np.array(self.zero_point)[0])

    def native_codes(self, x: np.ndarray) -> np.ndarray:
        """`codes_of` over a contiguous float32 array, in place."""
        scale, zero = self.constants()
        return kernels.requantize(x, scale, zero, divide=True, out="code")

    def np_dequantize(self, level: np.ndarray) -> np.ndarray:
        return (level - np.array(self.zero_point)) * np.array(self.scale)

    def np_codes_of(self, x: np.ndarray) -> np.ndarray:
        zero = np.array(self.zero_point)
        return np.clip(np.round(x / np.array(self.scale)) + zero, 0, 255) - zero


class QuantSoftmax(FakeQuant):
    """onnxruntime's QLinearSoftmax over uint8 levels, step for step: exp() read from a
    256-entry table shifted so that each row's largest level reads its last entry, the
    row summed in eight interleaved float lanes as its AVX2 kernel does, then scaled by
    floor(1 / scale) / sum and rounded. A table lookup, so no exp() runs per element."""

    LANES = 8

    def __init__(self) -> None:
        super().__init__()
        self._exp = mx.ones((256,))

    def build(self, in_scale: float, row_length: int) -> None:
        self._exp = mx.array(_softmax_table(in_scale, row_length))

    def codes_of_levels(self, levels: mx.array) -> mx.array:
        """The softmax of the last axis of input `levels`, as codes of this quantiser."""
        index = levels + (255 - levels.max(axis=-1, keepdims=True))
        e = mx.take(self._exp, index.astype(mx.uint32))
        lanes = e.reshape(*e.shape[:-1], -1, self.LANES)
        lane_sums = mx.cumsum(lanes, axis=-2)[..., -1, :]  # one element after another
        total = mx.cumsum(lane_sums, axis=-1)[..., -1:]
        scale = (1.0 / total) * mx.floor(1.0 / self.scale)
        level = mx.minimum(mx.round(e * scale + self.zero_point), 255)
        return level - self.zero_point

    def native_codes_of_sums(
        self, sums: np.ndarray, levels: FakeQuant, mult: np.float32
    ) -> np.ndarray:
        """`codes_of_levels` of the levels (of quantiser `levels`) of integer sums times
        `mult`, over a contiguous float32 array, in place."""
        scale, zero = self.constants()
        unit = np.floor(np.float32(1.0) / scale)
        return kernels.quant_softmax(
            sums, mult, levels.constants()[1], np.array(self._exp), unit, zero
        )


def _softmax_table(x_scale: float, reduce_len: int) -> np.ndarray:
    """QLinearSoftmax's exp() table for inputs of scale `x_scale` (computed in double
    with the headroom shift it builds in, then stored as float32)."""
    headroom = max(0.0, np.log(np.finfo(np.float32).max / reduce_len) - 5.0) / x_scale
    i = np.arange(256, dtype=np.float64)
    return np.exp((i - 255 + headroom) * np.float64(x_scale)).astype(np.float32)


def _fma(a: np.ndarray, b: np.ndarray | float, c: np.ndarray | float) -> np.ndarray:
    """float32 a * b + c rounded once, as an FMA instruction does (the float64 product of
    two float32 values is exact)."""
    return (a.astype(np.float64) * np.float64(b) + np.float64(c)).astype(np.float32)


_ERF_SMALL = (-5.99104969e-4, 4.99339588e-3, -2.67667342e-2, 1.12818025e-1, -3.76124859e-1)
_ERF_SMALL_LAST = 1.28379151e-1
_ERF_BIG = (1.72948930e-5, -3.83208680e-4, 3.88393435e-3, -2.42545605e-2, 1.06777847e-1)
_ERF_BIG_LAST = (6.34846687e-1, 1.28717512e-1)
_EXP_POLY = (1.38319808e-3, 8.37550033e-3, 4.16689515e-2, 1.66664466e-1, 4.99999851e-1, 1.0, 1.0)


def mlas_erf(x: np.ndarray) -> np.ndarray:
    """erf as onnxruntime's Erf computes it on x86-64 (MLAS's FMA3 kernel): a polynomial
    in x^2 below 0.921875, 1 - exp(-polynomial) above, each step one FMA."""
    f32 = np.float32
    x = np.asarray(x, f32)
    a = np.minimum(np.abs(x), f32(3.925))
    square = a * a
    small = np.full_like(a, f32(_ERF_SMALL[0]))
    for c in (*_ERF_SMALL[1:], _ERF_SMALL_LAST):
        small = _fma(small, square, f32(c))
    small = _fma(small, a, a)
    big_range = a > f32(0.921875)
    b = np.where(big_range, a, f32(0))
    big = np.full_like(a, f32(_ERF_BIG[0]))
    for c in (*_ERF_BIG[1:], *_ERF_BIG_LAST):
        big = _fma(big, b, f32(c))
    big = np.maximum(-_fma(big, b, b), f32(-88.3762626647949))
    magic = f32(1.25829120e7)  # 1.5 * 2^23: adding it rounds to an integer
    r = _fma(np.full_like(big, f32(1.44269504088896341)), big, magic) - magic
    fx = _fma(r, f32(-6.93145752e-1), big)
    fx = _fma(r, f32(-1.42860677e-6), fx)
    y = np.full_like(fx, f32(_EXP_POLY[0]))
    for c in _EXP_POLY[1:]:
        y = _fma(y, fx, f32(c))
    y = f32(1) - np.ldexp(y, r.astype(np.int32)).astype(f32)
    return np.copysign(np.where(big_range, y, small), x).astype(f32)


def mlas_gelu(x: np.ndarray) -> np.ndarray:
    """GELU as the exported graph spells it (x * ((erf(x / sqrt 2) + 1) * 0.5)), one
    float32 rounding per operation, with onnxruntime's erf."""
    f32 = np.float32
    x = np.asarray(x, f32)
    e = mlas_erf(x / f32(np.sqrt(2.0)))
    return (x * ((e + f32(1)) * f32(0.5))).astype(f32)


def gelu(x: mx.array) -> mx.array:
    """GELU in the exported graph's order of operations (so its rounding is the same)."""
    return x * ((mx.erf(x / np.float32(np.sqrt(2.0))) + 1.0) * 0.5)


class QuantLinear(nn.Module):
    """A quantised MatMul (or Gemm) with int8 per-channel weights, computed as
    onnxruntime's fused kernels do: integer products (exact in float32), then one float
    multiplier.

    `weight` holds the int8 codes. The encoder's projections add their float `bias`
    after the product is requantised; the Gemm layers (`int_bias`) add an int32 bias to
    the accumulator before.
    """

    def __init__(self, n_in: int, n_out: int, *, bias: bool = True, int_bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((n_out, n_in))
        self.weight_scale = mx.ones((n_out,))
        if bias:
            self.bias = mx.zeros((n_out,))
        self.out = FakeQuant()
        self._int_bias = int_bias

    def levels(self, codes: mx.array, in_scale: mx.array) -> mx.array:
        """The uint8 levels of the requantised product of input `codes` (of scale
        `in_scale`), before any float bias."""
        acc = codes @ self.weight.T
        if "bias" in self and self._int_bias:
            acc = acc + self.bias
        return self.out.level(acc * (in_scale * self.weight_scale / self.out.scale))

    def __call__(self, codes: mx.array, in_scale: mx.array) -> mx.array:
        y = self.out.dequantize(self.levels(codes, in_scale))
        return y + self.bias if "bias" in self and not self._int_bias else y

    def native(self, codes: np.ndarray, in_scale: np.float32, levels: bool = False) -> np.ndarray:
        """`__call__` (or `levels`) of one item's codes (rows, n_in) through the native
        kernels: the same float32 operations, the sums exact as in MLX."""
        if self._int_bias:
            raise ValueError("the native path serves the encoder's projections")
        taps, mult = _packed(self, in_scale, lambda w, ints: kernels.pack_taps(w[:, None, :], ints))
        acc = kernels.conv1d(codes, taps, length=len(codes), pad_left=0)
        scale, zero = self.out.constants()
        if levels:
            return kernels.requantize(acc, mult, zero)
        bias = np.array(self.bias) if "bias" in self else None
        return kernels.requantize(acc, mult, zero, out="value", scale=scale, bias=bias)


class QuantConv1d(nn.Module):
    """onnxruntime's QLinearConv: int8 per-channel weights (O, K, I), an int32 bias."""

    def __init__(self, n_in: int, n_out: int, *, stride: int) -> None:
        super().__init__()
        self.weight = mx.zeros((n_out, 3, n_in))
        self.weight_scale = mx.ones((n_out,))
        self.bias = mx.zeros((n_out,))
        self.out = FakeQuant()
        self._stride = stride

    def levels(self, codes: mx.array, in_scale: mx.array) -> mx.array:
        acc = mx.conv1d(codes, self.weight, stride=self._stride, padding=1) + self.bias
        return self.out.level(acc * (in_scale * self.weight_scale / self.out.scale))

    def native_levels(self, codes: np.ndarray, in_scale: np.float32) -> np.ndarray:
        """`levels` of one item's codes (rows, n_in) through the native kernels."""
        pack = kernels.pack_strided_taps if self._stride == 2 else kernels.pack_taps
        taps, mult = _packed(self, in_scale, pack)
        bias = np.array(self.bias)
        if self._stride == 2:
            acc = kernels.strided_conv1d(codes, taps, bias)
        else:
            acc = kernels.conv1d(codes, taps, length=len(codes), pad_left=1, bias=bias)
        return kernels.requantize(acc, mult, self.out.constants()[1])


class Lookup(nn.Module):
    """An elementwise function of a quantised tensor, read from a table over its 256
    levels (per channel where a float bias follows the levels). The table is computed
    once at load, in float32 step by step as onnxruntime computes the function, so a
    lookup gives the values it would, without running erf over every element."""

    def __init__(self) -> None:
        super().__init__()
        self._table = mx.zeros((256, 1))

    def build(self, values_of_levels: Callable[[np.ndarray], np.ndarray], channels: int) -> None:
        """Fill the table: `values_of_levels` maps a (256, channels) float32 array of
        the levels 0..255 to the function's values."""
        levels = np.broadcast_to(np.arange(256, dtype=np.float32)[:, None], (256, channels))
        self._table = mx.array(np.asarray(values_of_levels(levels), np.float32))

    def native(self, levels: np.ndarray) -> np.ndarray:
        table = getattr(self, "_np_table", None)
        if table is None or table[0] is not self._table:
            table = (self._table, np.array(self._table))
            object.__setattr__(self, "_np_table", table)
        return kernels.lookup(levels, table[1])

    def __call__(self, levels: mx.array) -> mx.array:
        channels = self._table.shape[1]
        index = levels.astype(mx.uint32) * channels
        if channels > 1:
            index = index + mx.arange(channels, dtype=mx.uint32)
        return mx.take(self._table.reshape(-1), index)


def int_matmul(
    a_codes: mx.array, a_scale: mx.array, b_codes: mx.array, b_scale: mx.array, out: FakeQuant
) -> mx.array:
    """onnxruntime's QLinearMatMul of two quantised activations: the integer product,
    requantised with the float multiplier a_scale * b_scale / out_scale; uint8 levels."""
    return out.level((a_codes @ b_codes) * (a_scale * b_scale / out.scale))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = QuantLinear(D_MODEL, D_MODEL)
        self.k_proj = QuantLinear(D_MODEL, D_MODEL, bias=False)
        self.v_proj = QuantLinear(D_MODEL, D_MODEL)
        self.out_proj = QuantLinear(D_MODEL, D_MODEL)
        # Where the export quantised the attention's intermediate values.
        self.q_scaled = FakeQuant()
        self.k_scaled = FakeQuant()
        self.v_heads = FakeQuant()
        self.scores = FakeQuant()
        self.weights = QuantSoftmax()
        self.context = FakeQuant()
        self.merged = FakeQuant()

    def __call__(self, codes: mx.array, in_scale: mx.array) -> mx.array:
        """Input codes (of `in_scale`) in; the output projection's float values out."""
        B, L, _ = codes.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(B, L, N_HEADS, -1).transpose(0, 2, 1, 3)

        # The 1/sqrt(head_dim) scale is split evenly between queries and keys.
        scale = (D_MODEL // N_HEADS) ** -0.25
        q = self.q_scaled.codes_of(heads(self.q_proj(codes, in_scale)) * scale)
        k = self.k_scaled.codes_of(heads(self.k_proj(codes, in_scale)) * scale)
        v = self.v_heads.codes_of(heads(self.v_proj(codes, in_scale)))
        scores = int_matmul(
            q, self.q_scaled.scale, k.transpose(0, 1, 3, 2), self.k_scaled.scale, self.scores
        )
        w = self.weights.codes_of_levels(scores)
        o = int_matmul(w, self.weights.scale, v, self.v_heads.scale, self.context)
        o = self.context.dequantize(o).transpose(0, 2, 1, 3).reshape(B, L, D_MODEL)
        return self.out_proj(self.merged.codes_of(o), self.merged.scale)

    def native(self, codes: np.ndarray, in_scale: np.float32) -> np.ndarray:
        """`__call__` over one item's codes (rows, D_MODEL), head by head."""
        scale = np.float32((D_MODEL // N_HEADS) ** -0.25)
        q = self.q_scaled.native_codes(self.q_proj.native(codes, in_scale) * scale)
        k = self.k_scaled.native_codes(self.k_proj.native(codes, in_scale) * scale)
        v = self.v_heads.native_codes(self.v_proj.native(codes, in_scale))
        (q_scale, _), (k_scale, _) = self.q_scaled.constants(), self.k_scaled.constants()
        (w_scale, _), (v_scale, _) = self.weights.constants(), self.v_heads.constants()
        score_mult = q_scale * k_scale / self.scores.constants()[0]
        context_scale, context_zero = self.context.constants()
        context_mult = w_scale * v_scale / context_scale
        merged = np.empty_like(q)
        width = D_MODEL // N_HEADS
        integers = kernels.integer_products()
        for h in range(N_HEADS):
            cols = slice(h * width, (h + 1) * width)
            sums = kernels.matmul(q[:, cols], k[:, cols].T, integers)
            w = self.weights.native_codes_of_sums(sums, self.scores, score_mult)
            o = kernels.matmul(w, v[:, cols], integers)
            kernels.requantize(o, context_mult, context_zero, out="value", scale=context_scale)
            merged[:, cols] = o
        merged_scale = self.merged.constants()[0]
        return self.out_proj.native(self.merged.native_codes(merged), merged_scale)


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(D_MODEL)
        self.attn_in = FakeQuant()
        self.self_attn = Attention()
        self.final_layer_norm = nn.LayerNorm(D_MODEL)
        self.mlp_in = FakeQuant()
        self.fc1 = QuantLinear(D_MODEL, 4 * D_MODEL)
        self.mlp_act = FakeQuant()
        self.fc2 = QuantLinear(4 * D_MODEL, D_MODEL)
        self.gelu_codes = Lookup()  # fc1's levels -> mlp_act's codes of gelu(fc1 + bias)

    def build_tables(self) -> None:
        def gelu_codes(levels: np.ndarray) -> np.ndarray:
            x = self.fc1.out.np_dequantize(levels) + np.array(self.fc1.bias)
            return self.mlp_act.np_codes_of(mlas_gelu(x))

        self.gelu_codes.build(gelu_codes, 4 * D_MODEL)
        attention = self.self_attn
        attention.weights.build(float(np.array(attention.scores.scale)[0]), N_FRAMES // 2)

    def __call__(self, x: mx.array) -> mx.array:
        attn_in = self.attn_in.codes_of(self.self_attn_layer_norm(x))
        x = x + self.self_attn(attn_in, self.attn_in.scale)
        mlp_in = self.mlp_in.codes_of(self.final_layer_norm(x))
        h = self.gelu_codes(self.fc1.levels(mlp_in, self.mlp_in.scale))
        return x + self.fc2(h, self.mlp_act.scale)

    def native(self, x: np.ndarray) -> np.ndarray:
        """The layer over one item's rows (rows, D_MODEL) through the native kernels. Its
        layer norms sum in another order than MLX's, so now and then a value lands on the
        other side of a rounding step of the quantiser after them."""
        attn_in = self.attn_in.native_codes(_layer_norm(self.self_attn_layer_norm, x))
        x = x + self.self_attn.native(attn_in, self.attn_in.constants()[0])
        mlp_in = self.mlp_in.native_codes(_layer_norm(self.final_layer_norm, x))
        h = self.gelu_codes.native(self.fc1.native(mlp_in, self.mlp_in.constants()[0], levels=True))
        return x + self.fc2.native(h, self.mlp_act.constants()[0])


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input = FakeQuant()
        self.conv1 = QuantConv1d(N_MELS, D_MODEL, stride=1)
        self.conv1_act = FakeQuant()
        self.conv2 = QuantConv1d(D_MODEL, D_MODEL, stride=2)
        self.embed_positions = mx.zeros((N_FRAMES // 2, D_MODEL))
        self.layers = [EncoderLayer() for _ in range(N_LAYERS)]
        self.layer_norm = nn.LayerNorm(D_MODEL)
        self.encoded = FakeQuant()
        self.pool1 = QuantLinear(D_MODEL, POOL_HIDDEN)
        self.pool_act = FakeQuant()
        self.pool2 = QuantLinear(POOL_HIDDEN, 1)
        self.pooled = FakeQuant()
        self.head1 = QuantLinear(D_MODEL, HEAD_HIDDEN[0], int_bias=True)
        self.head_norm = nn.LayerNorm(HEAD_HIDDEN[0])
        self.head1_act = FakeQuant()
        self.head2 = QuantLinear(*HEAD_HIDDEN, int_bias=True)
        self.head2_act = FakeQuant()
        self.head3 = QuantLinear(HEAD_HIDDEN[1], 1, int_bias=True)
        self.conv1_gelu_codes = Lookup()  # conv1's levels -> conv1_act's codes of gelu
        self.conv2_gelu = Lookup()  # conv2's levels -> gelu of them
        # On the CPU, the encoder item by item through `engine.native.kernels` (`load`).
        self.native = False

    def build_tables(self) -> None:
        """Compute the lookup tables from the loaded weights (`load` does it)."""
        act = self.conv1_act
        self.conv1_gelu_codes.build(
            lambda levels: act.np_codes_of(mlas_gelu(self.conv1.out.np_dequantize(levels))), 1
        )
        self.conv2_gelu.build(lambda levels: mlas_gelu(self.conv2.out.np_dequantize(levels)), 1)
        for layer in self.layers:
            layer.build_tables()

    def __call__(self, mel: mx.array) -> mx.array:
        """mel: (B, 800, 80) from `features`; returns (B,) turn-complete probabilities."""
        if self.native and mx.default_device() == mx.cpu:
            x = mx.array(np.stack([self._native(m) for m in np.array(mel)]))
        else:
            x = self.encode(mel)
        h = self.encoded.codes_of(self.layer_norm(x))
        # Attention pooling: a softmax over the frames weighs each frame's state.
        t = self.pool_act.codes_of(mx.tanh(self.pool1(h, self.encoded.scale)))
        weights = mx.softmax(self.pool2(t, self.pool_act.scale), axis=1)
        pooled = self.pooled.codes_of((self.encoded.dequantize_codes(h) * weights).sum(axis=1))
        y = self.head1_act.codes_of(gelu(self.head_norm(self.head1(pooled, self.pooled.scale))))
        y = self.head2_act.codes_of(gelu(self.head2(y, self.head1_act.scale)))
        return mx.sigmoid(self.head3(y, self.head2_act.scale))[:, 0]

    def encode(self, mel: mx.array) -> mx.array:
        """The convolutions and encoder layers over mel (B, 800, 80): (B, 400, D_MODEL)."""
        x = self.conv1_gelu_codes(self.conv1.levels(self.input.codes_of(mel), self.input.scale))
        x = self.conv2_gelu(self.conv2.levels(x, self.conv1_act.scale)) + self.embed_positions
        for layer in self.layers:
            x = layer(x)
        return x

    def _native(self, mel: np.ndarray) -> np.ndarray:
        """`encode` of one item's mel (800, 80) through the native kernels."""
        codes = self.input.native_codes(np.array(mel, np.float32))
        x = self.conv1_gelu_codes.native(self.conv1.native_levels(codes, self.input.constants()[0]))
        x = self.conv2_gelu.native(self.conv2.native_levels(x, self.conv1_act.constants()[0]))
        x = x + np.array(self.embed_positions)
        for layer in self.layers:
            x = layer.native(x)
        return x


def _packed(
    layer: QuantLinear | QuantConv1d,
    in_scale: np.float32,
    pack: Callable[[np.ndarray, bool], np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """A layer's weights as `pack` lays them out for the native kernels (in 16-bit
    integers where the CPU multiplies those, `kernels.integer_products`), and the float32
    multiplier from its integer sums to its output quantiser's levels (as `levels`
    computes it), made once per weight array and input scale."""
    cached = getattr(layer, "_packed", None)
    if cached is not None and cached[0] is layer.weight and cached[1] == in_scale:
        return cached[2]  # type: ignore[no-any-return]
    mult = in_scale * np.array(layer.weight_scale) / layer.out.constants()[0]
    packed = (pack(np.array(layer.weight), kernels.integer_products()), mult.astype(np.float32))
    object.__setattr__(layer, "_packed", (layer.weight, in_scale, packed))
    return packed


def load(model_dir: Path) -> Model:
    model = Model()
    model.load_weights(str(Path(model_dir) / "model.safetensors"), strict=True)
    model.build_tables()
    mx.eval(model.parameters())
    model.native = kernels.load()
    return model


# --- conversion from the ONNX file ---


def find_onnx(package_dir: Path) -> Path:
    """The ONNX file inside an unpacked `pipecat` package directory (or its parent)."""
    for root in (Path(package_dir), Path(package_dir) / "pipecat"):
        if (root / ONNX_RELATIVE).is_file():
            return root / ONNX_RELATIVE
    raise FileNotFoundError(f"no {ONNX_RELATIVE.name} under {package_dir}")


# The activations quantised in one encoder layer, in the order the export quantises them
# (with the ONNX op that produces each), and their place in the MLX model.
_LAYER_QUANTS = (
    ("LayerNormalization", "attn_in"),
    ("MatMul", "self_attn.{k}"),
    ("MatMul", "self_attn.{q}"),
    ("MatMul", "self_attn.{v}"),
    ("Transpose", "self_attn.v_heads"),
    ("Mul", "self_attn.q_scaled"),
    ("Mul", "self_attn.k_scaled"),
    ("MatMul", "self_attn.scores"),
    ("Softmax", "self_attn.weights"),
    ("MatMul", "self_attn.context"),
    ("Reshape", "self_attn.merged"),
    ("MatMul", "self_attn.out_proj.out"),
    ("LayerNormalization", "mlp_in"),
    ("MatMul", "fc1.out"),
    ("Mul", "mlp_act"),
    ("MatMul", "fc2.out"),
)
_INPUT_QUANTS = (
    ("input", "input"),
    ("Conv", "conv1.out"),
    ("Mul", "conv1_act"),
    ("Conv", "conv2.out"),
)
_HEAD_QUANTS = (
    ("LayerNormalization", "encoded"),
    ("MatMul", "pool1.out"),
    ("Tanh", "pool_act"),
    ("MatMul", "pool2.out"),
    ("ReduceSum", "pooled"),
    ("Gemm", "head1.out"),
    ("Mul", "head1_act"),
    ("Gemm", "head2.out"),
    ("Mul", "head2_act"),
    ("Gemm", "head3.out"),
)
# The weight-bearing ops in graph order, and their MLX names.
_LAYER_WEIGHTS = (
    "self_attn.{k}",
    "self_attn.{q}",
    "self_attn.{v}",
    "self_attn.out_proj",
    "fc1",
    "fc2",
)


class _Graph:
    """The ONNX graph with its constant tensors dequantised to float32."""

    def __init__(self, path: Path) -> None:
        import onnx
        from onnx import numpy_helper

        graph = onnx.load(str(path)).graph
        self.nodes = list(graph.node)
        self.consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.producer = {out: n for n in self.nodes for out in n.output}
        # Constant int8 weights and int32 biases: their codes (zero point removed) and
        # their scales, by the name of the dequantised tensor.
        self.quantised: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for node in self.nodes:
            if node.op_type == "DequantizeLinear" and node.input[0] in self.consts:
                self.quantised[node.output[0]] = self._codes(node)
        self.values = {**self.consts, **{k: c * s for k, (c, s) in self.quantised.items()}}

    def _codes(self, node: object) -> tuple[np.ndarray, np.ndarray]:
        q, scale, zero = (self.consts[name] for name in node.input)  # type: ignore[attr-defined]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)  # type: ignore[attr-defined]
        shape = [1] * q.ndim
        if scale.size > 1:  # per channel along `axis`
            shape[axis] = -1
        codes = q.astype(np.float32) - zero.astype(np.float32).reshape(shape)
        return codes, scale.astype(np.float32).reshape(shape)

    def consumers(self, tensor: str) -> list:
        return [n for n in self.nodes if tensor in n.input]

    def activation_quants(self) -> list[tuple[str, float, float, str]]:
        """(producing op, scale, zero point, quantised tensor) of every quantised
        activation, in graph order."""
        found = []
        for node in self.nodes:
            if node.op_type != "QuantizeLinear" or node.input[0] in self.consts:
                continue
            source = self.producer.get(node.input[0])
            op = source.op_type if source is not None else "input"
            scale, zero = (float(self.consts[name]) for name in node.input[1:])
            found.append((op, scale, zero, node.output[0]))
        return found

    def matmul_slot(self, quantised: str) -> int | None:
        """Which input (0 or 1) of a MatMul the dequantised `quantised` tensor is."""
        for dq in self.consumers(quantised):
            for user in self.consumers(dq.output[0]):
                if user.op_type == "MatMul":
                    return list(user.input).index(dq.output[0])
        return None

    def weight_ops(self) -> list:
        """MatMul, Gemm and Conv nodes whose second input is a constant weight."""
        return [
            n
            for n in self.nodes
            if n.op_type in ("MatMul", "Gemm", "Conv") and n.input[1] in self.values
        ]

    def bias_after(self, node: object) -> str | None:
        """The bias initializer added to `node`'s (quantised) output, if any."""
        tensor = node.output[0]  # type: ignore[attr-defined]
        for _ in range(3):  # MatMul -> QuantizeLinear -> DequantizeLinear -> Add
            following = self.consumers(tensor)
            if len(following) != 1:
                return None
            nxt = following[0]
            if nxt.op_type == "Add":
                return next((i for i in nxt.input if i in self.consts), None)
            tensor = nxt.output[0]
        return None


def _projection_names(graph: _Graph, matmuls: list) -> dict[str, str]:
    """Which of a layer's three input projections is q, k and v, from the biases they
    are followed by (k has none)."""
    names = {}
    for node, slot in zip(matmuls, "kqv", strict=True):
        bias = graph.bias_after(node) or ""
        names[slot] = "q_proj" if "q_proj" in bias else "v_proj" if "v_proj" in bias else "k_proj"
    if sorted(names.values()) != ["k_proj", "q_proj", "v_proj"]:
        raise ValueError(f"cannot tell the attention projections apart: {names}")
    return names


def read_weights(onnx_path: Path) -> dict[str, np.ndarray]:
    """The MLX model's parameters, by name, from the quantised ONNX graph."""
    graph = _Graph(onnx_path)
    v = graph.values
    out: dict[str, np.ndarray] = {}

    def put_weight(name: str, node: object, layout: Callable[[np.ndarray], np.ndarray]) -> None:
        codes, scale = graph.quantised[node.input[1]]  # type: ignore[attr-defined]
        out[f"{name}.weight"] = layout(codes)
        out[f"{name}.weight_scale"] = scale.reshape(-1)

    def put_int_bias(name: str, node: object) -> None:
        codes, _ = graph.quantised[node.input[2]]  # type: ignore[attr-defined]
        out[f"{name}.bias"] = codes

    ops = graph.weight_ops()
    if len(ops) != 2 + 6 * N_LAYERS + 5:
        raise ValueError(f"{onnx_path}: unexpected graph ({len(ops)} weight ops)")
    conv1, conv2, *encoder = ops[: 2 + 6 * N_LAYERS]
    pool1, pool2, head1, head2, head3 = ops[2 + 6 * N_LAYERS :]
    for name, node in (("conv1", conv1), ("conv2", conv2)):
        put_weight(name, node, lambda w: w.transpose(0, 2, 1))  # (O, I, K) -> (O, K, I)
        put_int_bias(name, node)
    out["embed_positions"] = v["inner.encoder.embed_positions.weight"]
    layer_names = []
    for i in range(N_LAYERS):
        nodes = encoder[6 * i : 6 * i + 6]
        slots = _projection_names(graph, nodes[:3])
        layer_names.append(slots)
        prefix = f"inner.encoder.layers.{i}"
        for template, node in zip(_LAYER_WEIGHTS, nodes, strict=True):
            name = f"layers.{i}." + template.format(**slots)
            put_weight(name, node, np.transpose)  # MatMul's (in, out) -> (out, in)
            bias = graph.bias_after(node)
            if bias is not None:
                out[f"{name}.bias"] = v[bias]
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            for p in ("weight", "bias"):
                out[f"layers.{i}.{norm}.{p}"] = v[f"{prefix}.{norm}.{p}"]
    for p in ("weight", "bias"):
        out[f"layer_norm.{p}"] = v[f"inner.encoder.layer_norm.{p}"]
        out[f"head_norm.{p}"] = v[f"inner.classifier.1.{p}"]
    for name, node in (("pool1", pool1), ("pool2", pool2)):
        put_weight(name, node, np.transpose)
        out[f"{name}.bias"] = v[graph.bias_after(node) or ""]
    for name, node in (("head1", head1), ("head2", head2), ("head3", head3)):
        put_weight(name, node, np.asarray)  # Gemm with transB: already (out, in)
        put_int_bias(name, node)
    out.update(_activation_quants(graph, layer_names))
    return {k: np.ascontiguousarray(a, dtype=np.float32) for k, a in out.items()}


def _activation_quants(graph: _Graph, layer_names: list[dict[str, str]]) -> dict[str, np.ndarray]:
    expected: list[tuple[str, str]] = list(_INPUT_QUANTS)
    for i, slots in enumerate(layer_names):
        for op, template in _LAYER_QUANTS:
            name = template.format(**{s: f"{p}.out" for s, p in slots.items()})
            expected.append((op, f"layers.{i}.{name}"))
    expected += _HEAD_QUANTS
    found = graph.activation_quants()
    ops = [op for op, _ in expected]
    if [op for op, *_ in found] != ops:
        raise ValueError("the quantised activations are not those of Smart Turn v3.2")
    out = {}
    for (_, name), (_, scale, zero, tensor) in zip(expected, found, strict=True):
        # The scaled queries and keys are both a Mul: the scores' MatMul tells them apart.
        if name.endswith(("q_scaled", "k_scaled")):
            slot = graph.matmul_slot(tensor)
            name = name[: -len("q_scaled")] + ("q_scaled" if slot == 0 else "k_scaled")
        out[f"{name}.scale"] = np.array([scale], np.float32)
        out[f"{name}.zero_point"] = np.array([zero], np.float32)
    return out


def convert(source_dir: Path, out_dir: Path, progress: Callable[[int, int], None]) -> None:
    """Write `model.safetensors` and `config.json` for `load` into `out_dir`."""
    progress(0, 2)
    weights = read_weights(find_onnx(source_dir))
    progress(1, 2)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out_dir / "model.safetensors"), {k: mx.array(a) for k, a in weights.items()}
    )
    config = {"model_type": "smart_turn", "version": "3.2", "sample_rate": SAMPLE_RATE}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    progress(2, 2)
