"""Kokoro-82M v1.0 (StyleTTS 2 with an iSTFTNet decoder) on MLX: ALBERT, the prosody
predictor (durations, F0 and energy curves), the text encoder and the decoder.
Layout is (batch, time, channels).

Weights come from `engine.models.kokoro_onnx.convert` (the int8 ONNX export,
dequantized). Work is split in two calls so a server can batch each: `prepare` runs the
text side for a batch of phoneme sequences, `decode` renders audio for any stack of
prepared items.

Batches are exact: every padded conv, instance norm and LSTM sees only its own item's
frames, as a lone item does; an item's audio in a batch equals its audio alone.

Speed on the CPU: the decoder is ~1.3 GFLOP per frame, nearly all of it 128/256-channel
convs at 20 and 120 times the frame rate. Every conv runs as one GEMM per tap
(vits' `Conv1d` "taps" mode), 75-100 GFLOP/s with the engine's BLAS against MLX's 1-58;
Snake's sin runs as a compiled polynomial (4x MLX's per-element `sin`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.models import fast_ops
from engine.models.vits import Conv1d as _VitsConv1d
from engine.models.vits import ConvTranspose1d, give_way

__all__ = ["ModelArgs", "Model", "load", "load_voices", "style_for"]


@dataclass
class ModelArgs:
    n_token: int = 178
    hidden_dim: int = 512
    style_dim: int = 128
    n_layer: int = 3
    max_dur: int = 50
    text_encoder_kernel_size: int = 5
    bert_hidden: int = 768
    bert_heads: int = 12
    bert_intermediate: int = 2048
    bert_layers: int = 12
    bert_embedding: int = 128
    bert_max_positions: int = 512
    upsample_rates: list[int] = field(default_factory=lambda: [10, 6])
    upsample_kernel_sizes: list[int] = field(default_factory=lambda: [20, 12])
    upsample_initial_channel: int = 512
    resblock_kernel_sizes: list[int] = field(default_factory=lambda: [3, 7, 11])
    resblock_dilation_sizes: list[list[int]] = field(
        default_factory=lambda: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    )
    n_fft: int = 20
    hop_length: int = 5
    harmonics: int = 9
    sine_amp: float = 0.1
    noise_std: float = 0.003
    voiced_threshold: float = 10.0
    sample_rate: int = 24000
    model_type: str = "kokoro"

    @classmethod
    def from_dict(cls, params: dict) -> ModelArgs:
        return cls(**{k: v for k, v in params.items() if k in cls.__dataclass_fields__})

    @property
    def samples_per_frame(self) -> int:
        # The F0 curve runs at twice the duration frame rate; the generator upsamples that.
        return 2 * int(np.prod(self.upsample_rates)) * self.hop_length


# --- elementwise pieces ----------------------------------------------------------------

_compiled = partial(mx.compile, shapeless=True)
# Adding and subtracting 1.5 * 2^23 rounds a float32 to the nearest integer in two
# vectorized ops (MLX's CPU `round` and `floor` go one element at a time).
_ROUNDER = 12582912.0
# pi in two parts, the first exact in few bits, so n * _PI_HIGH has no rounding error.
_PI_HIGH = 3.140625
_PI_LOW = 9.67653589793e-4


@_compiled
def _reduced(z: mx.array) -> mx.array:
    # z - n pi for the nearest integer n: sin^2 has period pi, so r in [-pi/2, pi/2].
    n = (z * (1 / math.pi) + _ROUNDER) - _ROUNDER
    return (z - n * _PI_HIGH) - n * _PI_LOW


@_compiled
def _plus_sin_squared(z: mx.array, r: mx.array) -> mx.array:
    # sin(r) for |r| <= pi/2 by its Taylor polynomial to r^11 (error < 6e-8).
    r2 = r * r
    s = r * (
        1.0 + r2 * (-1 / 6 + r2 * (1 / 120 + r2 * (-1 / 5040 + r2 * (1 / 362880 - r2 / 39916800))))
    )
    return z + s * s


def _adain_snake(
    x: mx.array, scale: mx.array, shift: mx.array, alpha: mx.array, mask: mx.array
) -> mx.array:
    """Snake of y = x * scale + shift, y + sin^2(alpha y) / alpha, zeroed past each
    item's end, as (z + sin^2 z) / alpha with z = alpha y. The compiled stages take
    only same-shape arrays: broadcast operands make MLX's fused CPU loops index every
    element (twice as slow); the plain broadcast ops stay vectorized."""
    z = x * (scale * alpha) + shift * alpha
    return _plus_sin_squared(z, _reduced(z)) * (1 / alpha) * mask


def _affine_leaky(
    x: mx.array, scale: mx.array, shift: mx.array, slope: float, mask: mx.array
) -> mx.array:
    y = x * scale + shift
    return mx.maximum(y, slope * y) * mask


def _leaky(x: mx.array, slope: float) -> mx.array:
    return mx.maximum(x, slope * x)


def _instance_stats(
    x: mx.array, mask: mx.array, count: mx.array, eps: float = 1e-5
) -> tuple[mx.array, mx.array]:
    """Mean and 1/std over each item's own frames ([B, 1, C] each)."""
    mean = (x * mask).sum(axis=1, keepdims=True) / count
    d = (x - mean) * mask
    var = (d * d).sum(axis=1, keepdims=True) / count
    return mean, mx.rsqrt(var + eps)


def _frame_mask(lengths: np.ndarray, T: int) -> tuple[mx.array, mx.array]:
    """[B, T, 1] float mask of each item's first lengths[b] frames, and the counts [B, 1, 1]."""
    n = mx.array(np.asarray(lengths, dtype=np.int32))
    mask = (mx.arange(T)[None, :] < n[:, None]).astype(mx.float32)[..., None]
    return mask, n.astype(mx.float32)[:, None, None]


# --- layers ----------------------------------------------------------------------------


class Conv1d(_VitsConv1d):
    """vits' same-padded conv, always as one GEMM per tap: with the engine's BLAS that
    beats `mx.conv1d` at every width this model has, not only narrow or dilated ones."""

    def _use_taps(self) -> bool:
        return self.mode == "taps" and self.groups == 1


class StridedConv1d(nn.Module):
    """Conv with kernel 2 * stride: each output reads two adjacent stride-sized blocks
    of the padded input, so it is one GEMM over those blocks side by side."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, padding: int) -> None:
        super().__init__()
        self.weight = mx.zeros((out_ch, 2 * stride, in_ch))
        self.bias = mx.zeros((out_ch,))
        self.stride = stride
        self.padding = padding

    def __call__(self, x: mx.array) -> mx.array:
        B, L, C = x.shape
        s, p = self.stride, self.padding
        out_len = (L + 2 * p - 2 * s) // s + 1
        total = (out_len + 1) * s
        x = mx.pad(x, [(0, 0), (p, max(0, total - L - p)), (0, 0)])[:, :total]
        blocks = x.reshape(B, out_len + 1, s * C)
        cols = mx.concatenate([blocks[:, :-1], blocks[:, 1:]], axis=-1)
        return cols @ self.weight.reshape(self.weight.shape[0], -1).T + self.bias


class UpsamplePool(nn.Module):
    """The depthwise transposed conv (kernel 3, stride 2, padding 1, output padding 1)
    that doubles the frame rate, as elementwise ops: y[2j] = w1 x[j], y[2j+1] = w0
    x[j+1] + w2 x[j]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = mx.zeros((channels, 3))
        self.bias = mx.zeros((channels,))

    def __call__(self, x: mx.array) -> mx.array:
        B, L, C = x.shape
        w = self.weight
        nxt = mx.pad(x[:, 1:], [(0, 0), (0, 1), (0, 0)])
        even = x * w[:, 1] + self.bias
        odd = nxt * w[:, 0] + x * w[:, 2] + self.bias
        return mx.stack([even, odd], axis=2).reshape(B, 2 * L, C)


class AdaIN(nn.Module):
    def __init__(self, style_dim: int, channels: int) -> None:
        super().__init__()
        self.fc = nn.Linear(style_dim, 2 * channels)

    def affine(
        self, x: mx.array, s: mx.array, mask: mx.array, count: mx.array
    ) -> tuple[mx.array, mx.array]:
        """(scale, shift) so that x * scale + shift is the style-modulated instance norm."""
        gamma, beta = mx.split(self.fc(s)[:, None, :], 2, axis=-1)
        mean, rstd = _instance_stats(x, mask, count)
        scale = (1 + gamma) * rstd
        return scale, beta - mean * scale


class AdaLayerNorm(nn.Module):
    def __init__(self, style_dim: int, channels: int) -> None:
        super().__init__()
        self.fc = nn.Linear(style_dim, 2 * channels)

    def __call__(self, x: mx.array, s: mx.array) -> mx.array:
        gamma, beta = mx.split(self.fc(s)[:, None, :], 2, axis=-1)
        return (1 + gamma) * mx.fast.layer_norm(x, None, None, 1e-5) + beta


@mx.compile
def _lstm_step(gx: mx.array, h: mx.array, c: mx.array, wh: mx.array) -> tuple[mx.array, mx.array]:
    # Gates in the ONNX export's order: input, output, forget, cell. One product per
    # direction against transposed weights: the engine's few-row kernel sums each row in
    # the same order whatever the batch (up to 8 rows), so items stay bit-exact alone.
    g = gx + mx.stack([h[0] @ wh[0].T, h[1] @ wh[1].T])
    H = h.shape[-1]
    ifo = mx.sigmoid(g[..., : 3 * H])
    c = ifo[..., 2 * H :] * c + ifo[..., :H] * mx.tanh(g[..., 3 * H :])
    return ifo[..., H : 2 * H] * mx.tanh(c), c


def _reverse_index(lengths: np.ndarray, L: int) -> mx.array:
    """Per item, time t -> lengths - 1 - t inside the item (padding stays put): the
    reverse direction then starts at each item's own last frame."""
    t = np.arange(L)[None, :]
    n = np.asarray(lengths)[:, None]
    return mx.array(np.where(t < n, n - 1 - t, t).astype(np.int32))


class BiLSTM(nn.Module):
    def __init__(self, in_dim: int, hidden: int) -> None:
        super().__init__()
        self.wx = mx.zeros((2, 4 * hidden, in_dim))
        self.wh = mx.zeros((2, 4 * hidden, hidden))
        self.bias = mx.zeros((2, 4 * hidden))

    def __call__(self, x: mx.array, lengths: np.ndarray) -> mx.array:
        B, L, _ = x.shape
        H = self.wh.shape[2]
        rev = _reverse_index(lengths, L)[..., None]
        xr = mx.take_along_axis(x, rev, axis=1)
        gx = mx.stack([x @ self.wx[0].T + self.bias[0], xr @ self.wx[1].T + self.bias[1]])
        h = mx.zeros((2, B, H))
        c = mx.zeros((2, B, H))
        outs = []
        for t in range(L):
            h, c = _lstm_step(gx[:, :, t], h, c, self.wh)
            outs.append(h)
        hs = mx.stack(outs, axis=2)
        return mx.concatenate([hs[0], mx.take_along_axis(hs[1], rev, axis=1)], axis=-1)


# --- ALBERT ----------------------------------------------------------------------------


def _gelu_tanh(x: mx.array) -> mx.array:
    # ALBERT's "gelu_new" (the export's FastGelu): the tanh approximation.
    return 0.5 * x * (1 + fast_ops.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


class AlbertLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D = args.bert_hidden
        self.heads = args.bert_heads
        self.query = nn.Linear(D, D)
        self.key = nn.Linear(D, D)
        self.value = nn.Linear(D, D)
        self.dense = nn.Linear(D, D)
        self.attention_norm = nn.LayerNorm(D, eps=1e-12)
        self.ffn = nn.Linear(D, args.bert_intermediate)
        self.ffn_output = nn.Linear(args.bert_intermediate, D)
        self.ffn_norm = nn.LayerNorm(D, eps=1e-12)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        B, L, D = x.shape
        q, k, v = (
            p(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
            for p in (self.query, self.key, self.value)
        )
        a = fast_ops.attention(q, k, v, 1 / math.sqrt(q.shape[-1]), mask)
        x = self.attention_norm(x + self.dense(a.transpose(0, 2, 1, 3).reshape(B, L, D)))
        return self.ffn_norm(x + self.ffn_output(_gelu_tanh(self.ffn(x))))


class Albert(nn.Module):
    """ALBERT: one layer's weights shared by all `bert_layers` passes (no pooler)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        E = args.bert_embedding
        self.word_embeddings = nn.Embedding(args.n_token, E)
        self.position_embeddings = nn.Embedding(args.bert_max_positions, E)
        self.token_type_embeddings = nn.Embedding(2, E)
        self.embedding_norm = nn.LayerNorm(E, eps=1e-12)
        self.mapping_in = nn.Linear(E, args.bert_hidden)
        self.layer = AlbertLayer(args)
        self.n_layers = args.bert_layers

    def __call__(self, ids: mx.array, key_mask: mx.array) -> mx.array:
        L = ids.shape[1]
        x = self.word_embeddings(ids) + self.position_embeddings(mx.arange(L))
        x = self.embedding_norm(x + self.token_type_embeddings.weight[0])
        x = self.mapping_in(x)
        for _ in range(self.n_layers):
            x = self.layer(x, key_mask)
        return x


# --- prosody predictor and text encoder -----------------------------------------------


class AdainResBlk1d(nn.Module):
    """Style-modulated residual block (leaky ReLU 0.2), optionally doubling the rate."""

    def __init__(self, dim_in: int, dim_out: int, style_dim: int, upsample: bool = False):
        super().__init__()
        self.norm1 = AdaIN(style_dim, dim_in)
        self.norm2 = AdaIN(style_dim, dim_out)
        self.conv1 = Conv1d(dim_in, dim_out, 3)
        self.conv2 = Conv1d(dim_out, dim_out, 3)
        if dim_in != dim_out:
            self.conv1x1 = Conv1d(dim_in, dim_out, 1, bias=False)
        if upsample:
            self.pool = UpsamplePool(dim_in)
        self.upsample = upsample

    def __call__(self, x: mx.array, s: mx.array, masks: list[tuple[mx.array, mx.array]]):
        """`masks` holds (mask, count) at the input rate and, if upsampling, at twice it."""
        mask, count = masks[0]
        h = _affine_leaky(x, *self.norm1.affine(x, s, mask, count), 0.2, mask)
        if self.upsample:
            mask, count = masks[1]
            h = self.pool(h) * mask
            x = mx.repeat(x, 2, axis=1)
        h = self.conv1(h)
        h = self.conv2(_affine_leaky(h, *self.norm2.affine(h, s, mask, count), 0.2, mask))
        shortcut = self.conv1x1(x) if "conv1x1" in self else x
        return (h + shortcut) * (1 / math.sqrt(2))


class DurationEncoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D, S = args.hidden_dim, args.style_dim
        self.lstms = [BiLSTM(D + S, D // 2) for _ in range(args.n_layer)]
        self.norms = [AdaLayerNorm(S, D) for _ in range(args.n_layer)]

    def __call__(self, x: mx.array, s: mx.array, lengths: np.ndarray, mask: mx.array):
        style = mx.broadcast_to(s[:, None, :], (*x.shape[:2], s.shape[-1]))
        x = mx.concatenate([x, style], axis=-1) * mask
        for lstm, norm in zip(self.lstms, self.norms, strict=True):
            x = norm(lstm(x, lengths) * mask, s)
            x = mx.concatenate([x, style], axis=-1) * mask
        return x


class ProsodyPredictor(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D, S = args.hidden_dim, args.style_dim
        self.text_encoder = DurationEncoder(args)
        self.lstm = BiLSTM(D + S, D // 2)
        self.duration_proj = nn.Linear(D, args.max_dur)
        self.shared = BiLSTM(D + S, D // 2)
        self.F0 = self._curve_blocks(D, S)
        self.N = self._curve_blocks(D, S)
        self.F0_proj = Conv1d(D // 2, 1, 1)
        self.N_proj = Conv1d(D // 2, 1, 1)

    @staticmethod
    def _curve_blocks(D: int, S: int) -> list[AdainResBlk1d]:
        return [
            AdainResBlk1d(D, D, S),
            AdainResBlk1d(D, D // 2, S, upsample=True),
            AdainResBlk1d(D // 2, D // 2, S),
        ]

    def curves(self, en: mx.array, s: mx.array, frames: np.ndarray) -> tuple[mx.array, ...]:
        """F0 and energy [B, 2T] of aligned features [B, T, D + S]."""
        T = en.shape[1]
        m1 = _frame_mask(frames, T)
        m2 = _frame_mask(2 * frames, 2 * T)
        x = self.shared(en, frames)
        out = []
        for blocks, proj in ((self.F0, self.F0_proj), (self.N, self.N_proj)):
            h = blocks[0](x, s, [m1])
            h = blocks[1](h, s, [m1, m2])
            h = blocks[2](h, s, [m2])
            out.append(proj(h)[..., 0] * m2[0][..., 0])
        return out[0], out[1]


class TextEncoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D, K = args.hidden_dim, args.text_encoder_kernel_size
        self.embedding = nn.Embedding(args.n_token, D)
        self.convs = [Conv1d(D, D, K) for _ in range(args.n_layer)]
        self.norms = [nn.LayerNorm(D, eps=1e-5) for _ in range(args.n_layer)]
        self.lstm = BiLSTM(D, D // 2)

    def __call__(self, ids: mx.array, lengths: np.ndarray, mask: mx.array) -> mx.array:
        x = self.embedding(ids) * mask
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = _leaky(norm(conv(x)), 0.2) * mask
        return self.lstm(x, lengths) * mask


# --- decoder ---------------------------------------------------------------------------


class AdaINResBlock1(nn.Module):
    """HiFi-GAN resblock "1" with AdaIN and Snake: per dilation, two convs."""

    def __init__(self, channels: int, kernel: int, dilations: list[int], style_dim: int):
        super().__init__()
        n = len(dilations)
        self.convs1 = [Conv1d(channels, channels, kernel, dilation=d) for d in dilations]
        self.convs2 = [Conv1d(channels, channels, kernel) for _ in dilations]
        self.adain1 = [AdaIN(style_dim, channels) for _ in range(n)]
        self.adain2 = [AdaIN(style_dim, channels) for _ in range(n)]
        self.alpha1 = [mx.ones((channels,)) for _ in range(n)]
        self.alpha2 = [mx.ones((channels,)) for _ in range(n)]

    def __call__(self, x: mx.array, s: mx.array, mask: mx.array, count: mx.array) -> mx.array:
        for c1, c2, n1, n2, a1, a2 in zip(
            self.convs1,
            self.convs2,
            self.adain1,
            self.adain2,
            self.alpha1,
            self.alpha2,
            strict=True,
        ):
            scale, shift = n1.affine(x, s, mask, count)
            h = c1(_adain_snake(x, scale, shift, a1, mask))
            scale, shift = n2.affine(h, s, mask, count)
            x = c2(_adain_snake(h, scale, shift, a2, mask), residual=x)
        return x


class SourceModule(nn.Module):
    """Harmonic-plus-noise excitation from the F0 curve (NSF's SineGen, then a linear
    merge of the harmonics and tanh)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.l_linear = nn.Linear(args.harmonics, 1)
        self.args = args

    def __call__(self, f0: mx.array, key: mx.array | None, frames: np.ndarray) -> mx.array:
        """f0 [B, 2T] (zero past each item) -> excitation [B, 2T * up] at the audio rate.

        Kokoro's random initial phases touch only sample 0, which the linear downsampling
        never reads, so they are left out. The additive noise (per harmonic, before the
        merge) is drawn as one Gaussian per sample with the merged standard deviation,
        for each item from `key` itself and the item's own length, so it does not depend
        on the batch (None: no noise, as in the ONNX export).
        """
        a = self.args
        up = a.samples_per_frame // 2
        B, F = f0.shape
        h = mx.arange(1, a.harmonics + 1, dtype=mx.float32)
        rad = f0[..., None] * h / a.sample_rate
        rad = rad - mx.floor(rad)
        # Phase per F0 frame, then linear interpolation to the audio rate (half-pixel
        # centres, clamped at the ends): past an item's end f0 is 0, so its phase holds.
        phase = mx.cumsum(rad, axis=1) * (2 * math.pi * up)
        src = np.maximum((np.arange(F * up) + 0.5) / up - 0.5, 0.0)
        lo = np.floor(src).astype(np.int32)
        frac = mx.array((src - lo).astype(np.float32))[None, :, None]
        hi = mx.array(np.minimum(lo + 1, F - 1))
        p = phase[:, mx.array(lo)] * (1 - frac) + phase[:, hi] * frac
        f0_up = mx.repeat(f0, up, axis=1)
        uv = (f0_up > a.voiced_threshold).astype(mx.float32)
        w = self.l_linear.weight[0]
        merged = (mx.sin(p) @ w) * (a.sine_amp * uv) + self.l_linear.bias
        if key is not None:
            amp = (uv * a.noise_std + (1 - uv) * a.sine_amp / 3) * mx.linalg.norm(w)
            noise = [
                mx.pad(mx.random.normal((int(n) * 2 * up,), key=key), (0, (F - 2 * int(n)) * up))
                for n in frames
            ]
            merged = merged + amp * mx.stack(noise)
        return fast_ops.tanh(merged)


def _hann(n: int) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float64)


class STFT:
    """The generator's STFT and inverse (Hann window, centred, reflect-padded), as small
    GEMMs against DFT matrices. Frames are hop-sized blocks side by side (n_fft is a
    multiple of the hop)."""

    def __init__(self, n_fft: int, hop: int) -> None:
        self.n_fft, self.hop = n_fft, hop
        self.blocks = n_fft // hop
        w = _hann(n_fft)
        bins = n_fft // 2 + 1
        angle = 2 * np.pi * np.outer(np.arange(n_fft), np.arange(bins)) / n_fft
        self.forward = mx.array(
            np.concatenate([np.cos(angle), -np.sin(angle)], 1) * w[:, None], mx.float32
        )
        # irfft: bins 1..n/2-1 count twice, and the edge bins' imaginary parts not at all.
        c = np.full(bins, 2.0)
        c[0] = c[-1] = 1.0
        inv_im = -np.sin(angle.T) * c[:, None]
        inv_im[[0, -1]] = 0.0
        self.inverse = mx.array(
            np.concatenate([np.cos(angle.T) * c[:, None], inv_im], 0) * w[None, :] / n_fft,
            mx.float32,
        )
        self.window_sq = mx.array((w * w).reshape(self.blocks, hop), mx.float32)
        # The export's inverse is torch.istft's times the steady overlap of the squared
        # window (1.5 for Hann at n_fft / hop = 4): kept, so the levels match it.
        self.gain = float((w * w).reshape(self.blocks, hop).sum(axis=0).mean())

    def _frames(self, blocks: mx.array, count: int) -> mx.array:
        return mx.concatenate([blocks[:, k : k + count] for k in range(self.blocks)], axis=-1)

    def transform(self, x: mx.array, lengths: np.ndarray) -> mx.array:
        """[B, N] -> [B, N / hop + 1, magnitudes then phases]; item b is reflect-padded at
        its own length."""
        B, N = x.shape
        pad = self.n_fft // 2
        pos = np.arange(-pad, N + pad)[None, :]
        n = np.asarray(lengths)[:, None]
        idx = np.abs(pos)
        idx = np.where(idx >= n, 2 * (n - 1) - idx, idx)
        x = mx.take_along_axis(x, mx.array(np.clip(idx, 0, N - 1).astype(np.int32)), axis=1)
        F = N // self.hop + 1
        spec = self._frames(x.reshape(B, -1, self.hop), F) @ self.forward
        bins = self.n_fft // 2 + 1
        re, im = spec[..., :bins], spec[..., bins:]
        mag = mx.sqrt(re * re + im * im)
        phase = mx.arctan2(im, re)
        # The DC and Nyquist bins are real, their phase 0 or +-pi: the export's STFT
        # leaves a rounding-sized imaginary part that makes it +pi at DC, -pi at Nyquist.
        neg = re < 0
        dc = mx.where(neg[..., :1], math.pi, 0.0)
        nyquist = mx.where(neg[..., -1:], -math.pi, 0.0)
        phase = mx.concatenate([dc, phase[..., 1:-1], nyquist], axis=-1)
        return mx.concatenate([mag, phase], axis=-1)

    def inverse_transform(self, spec: mx.array, mask: mx.array) -> mx.array:
        """[B, F, real then imaginary] -> [B, (F - 1) * hop], each item normalised by its
        own frames' window overlap (as torch.istft), times `gain`."""
        B, F, _ = spec.shape
        frames = (spec @ self.inverse) * mask
        k = self.blocks
        env_frames = mx.broadcast_to(self.window_sq.reshape(1, 1, -1), (B, F, self.n_fft)) * mask

        def overlap_add(fr: mx.array) -> mx.array:
            parts = fr.reshape(B, F, k, self.hop)
            out = mx.pad(parts[:, :, 0], [(0, 0), (0, k - 1), (0, 0)])
            for j in range(1, k):
                out = out + mx.pad(parts[:, :, j], [(0, 0), (j, k - 1 - j), (0, 0)])
            return out.reshape(B, -1)

        y, env = overlap_add(frames), overlap_add(env_frames)
        y = y * (self.gain / mx.maximum(env, 1e-11))
        pad = self.n_fft // 2
        return y[:, pad : pad + (F - 1) * self.hop]


class Generator(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        C, S = args.upsample_initial_channel, args.style_dim
        self.m_source = SourceModule(args)
        rates, kernels = args.upsample_rates, args.upsample_kernel_sizes
        self.ups = [
            ConvTranspose1d(C >> i, C >> (i + 1), k, u, (k - u) // 2)
            for i, (u, k) in enumerate(zip(rates, kernels, strict=True))
        ]
        self.resblocks = [
            AdaINResBlock1(C >> (i + 1), k, d, S)
            for i in range(len(rates))
            for k, d in zip(args.resblock_kernel_sizes, args.resblock_dilation_sizes, strict=True)
        ]
        bins = args.n_fft + 2
        stride = int(np.prod(rates[1:]))
        self.noise_convs: list[nn.Module] = [StridedConv1d(bins, C >> 1, stride, (stride + 1) // 2)]
        self.noise_convs.append(Conv1d(bins, C >> 2, 1))
        self.noise_res = [
            AdaINResBlock1(C >> 1, 7, [1, 3, 5], S),
            AdaINResBlock1(C >> 2, 11, [1, 3, 5], S),
        ]
        self.conv_post = Conv1d(C >> 2, bins, 7)
        self.stft = STFT(args.n_fft, args.hop_length)
        self.rates = rates
        self.n_kernels = len(args.resblock_kernel_sizes)
        if len(rates) != 2:
            raise ValueError("the generator is written for two upsampling stages")

    def __call__(
        self,
        x: mx.array,
        s: mx.array,
        f0: mx.array,
        frames: np.ndarray,
        key: mx.array | None,
        pause: Callable[[], None] | None = None,
    ) -> mx.array:
        """x [B, 2T, C] at the F0 rate -> audio [B, 2T * samples_per_f0_frame]."""
        F = f0.shape[1]
        r0, r1 = self.rates
        n_f0 = 2 * frames
        excitation = self.m_source(f0, key, frames)
        samples = n_f0 * r0 * r1 * self.stft.hop
        har = self.stft.transform(excitation, samples)
        n_har = n_f0 * r0 * r1 + 1
        m_har = _frame_mask(n_har, har.shape[1])
        har = har * m_har[0]
        stages = [_frame_mask(n_f0 * r0, F * r0), m_har]
        mask = _frame_mask(n_f0, F)[0]
        for i, up in enumerate(self.ups):
            x = up(_leaky(x, 0.1) * mask)
            mask, count = stages[i]
            source = self.noise_res[i](self.noise_convs[i](har), s, mask, count)
            if i == len(self.ups) - 1:
                x = mx.concatenate([x[:, 1:2], x], axis=1)  # reflection pad (1, 0)
            x = x + source
            blocks = self.resblocks[i * self.n_kernels : (i + 1) * self.n_kernels]
            xs = blocks[0](x, s, mask, count)
            for block in blocks[1:]:
                give_way(xs, pause)
                xs = xs + block(x, s, mask, count)
            x = xs / self.n_kernels
            give_way(x, pause)
        x = self.conv_post(_leaky(x, 0.01) * mask)
        bins = self.stft.n_fft // 2 + 1
        mag = mx.exp(x[..., :bins])
        phase = mx.sin(x[..., bins:])
        spec = mx.concatenate([mag * mx.cos(phase), mag * mx.sin(phase)], axis=-1)
        return self.stft.inverse_transform(spec, mask)


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D, S = args.hidden_dim, args.style_dim
        self.encode = AdainResBlk1d(D + 2, 1024, S)
        res = 64
        self.decode = [AdainResBlk1d(1024 + 2 + res, 1024, S) for _ in range(3)]
        self.decode.append(AdainResBlk1d(1024 + 2 + res, D, S, upsample=True))
        self.F0_conv = mx.zeros((3,))
        self.F0_bias = mx.zeros((1,))
        self.N_conv = mx.zeros((3,))
        self.N_bias = mx.zeros((1,))
        self.asr_res = Conv1d(D, res, 1)
        self.generator = Generator(args)

    @staticmethod
    def _halve(curve: mx.array, w: mx.array, b: mx.array) -> mx.array:
        # Conv(1 -> 1, kernel 3, stride 2, padding 1): frame t reads 2t - 1, 2t, 2t + 1.
        pairs = curve.reshape(curve.shape[0], -1, 2)
        prev = mx.pad(pairs[:, :-1, 1], [(0, 0), (1, 0)])
        return (prev * w[0] + pairs[..., 0] * w[1] + pairs[..., 1] * w[2] + b)[..., None]

    def __call__(
        self,
        asr: mx.array,
        f0: mx.array,
        n: mx.array,
        s: mx.array,
        frames: np.ndarray,
        key: mx.array | None,
        pause: Callable[[], None] | None = None,
    ) -> mx.array:
        T = asr.shape[1]
        m1 = _frame_mask(frames, T)
        m2 = _frame_mask(2 * frames, 2 * T)
        F0 = self._halve(f0, self.F0_conv, self.F0_bias)
        N = self._halve(n, self.N_conv, self.N_bias)
        x = self.encode(mx.concatenate([asr, F0, N], axis=-1), s, [m1])
        asr_res = self.asr_res(asr)
        for block in self.decode:
            give_way(x, pause)
            x = mx.concatenate([x, asr_res, F0, N], axis=-1)
            x = block(x, s, [m1, m2] if block.upsample else [m1])
        give_way(x, pause)
        return self.generator(x, s, f0, frames, key, pause)


# --- the whole model -------------------------------------------------------------------


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.bert = Albert(args)
        self.bert_encoder = nn.Linear(args.bert_hidden, args.hidden_dim)
        self.predictor = ProsodyPredictor(args)
        self.text_encoder = TextEncoder(args)
        self.decoder = Decoder(args)
        self.samples_per_frame = args.samples_per_frame

    def durations(
        self, ids: mx.array, lengths: mx.array, styles: mx.array, speeds: mx.array
    ) -> tuple[mx.array, np.ndarray, np.ndarray]:
        """Duration-encoder features [B, L, D + S] and integer frames per phoneme [B, L]."""
        B, L = ids.shape
        n = np.array(lengths).astype(np.int64)
        mask, _ = _frame_mask(n, L)
        key_mask = (mask[:, :, 0] > 0)[:, None, None, :]
        s = styles[:, self.args.style_dim :]
        d_en = self.bert_encoder(self.bert(ids, key_mask))
        d = self.predictor.text_encoder(d_en, s, n, mask)
        x = self.predictor.lstm(d, n)
        total = mx.sigmoid(self.predictor.duration_proj(x)).sum(axis=-1) / speeds[:, None]
        # np.round rounds half to even, as torch.round does.
        dur = np.maximum(np.round(np.array(total)), 1).astype(np.int64)
        dur[np.arange(L)[None, :] >= n[:, None]] = 0
        return d, dur, n

    def prepare(
        self, ids: mx.array, lengths: mx.array, styles: mx.array, speeds: mx.array
    ) -> tuple[mx.array, np.ndarray]:
        """The decoder's inputs for a batch of phoneme sequences, and each one's frames.

        ids [B, L] int32, each item wrapped in the pad id 0 and zero-padded past
        lengths[b]; styles [B, 256] (the voice rows); speeds [B]. Returns features
        [B, T, C] with C = hidden_dim + 4 + style_dim, per frame t:
          [:hidden_dim]   aligned text-encoder features (the decoder's "asr"),
          [hidden_dim:+2] the F0 curve at frames 2t and 2t + 1,
          [+2:+4]         the energy (N) curve at frames 2t and 2t + 1,
          [-style_dim:]   the decoder's style (styles[:, :style_dim]) on every frame;
        zeros past the item's frames[b].
        """
        styles = styles.astype(mx.float32)
        d, dur, n = self.durations(ids, lengths, styles, speeds.astype(mx.float32))
        return self.align(ids, n, styles, d, dur)

    def align(
        self, ids: mx.array, n: np.ndarray, styles: mx.array, d: mx.array, dur: np.ndarray
    ) -> tuple[mx.array, np.ndarray]:
        """`prepare`'s second half, for given durations (`durations` gives d and dur)."""
        frames, index = _expand_index(dur)
        T = index.shape[1]
        idx = mx.array(index)[..., None]
        mask, _ = _frame_mask(frames, T)
        S = self.args.style_dim
        en = mx.take_along_axis(d, idx, axis=1) * mask
        f0, energy = self.predictor.curves(en, styles[:, S:], frames)
        t_en = self.text_encoder(ids, n, _frame_mask(n, ids.shape[1])[0])
        asr = mx.take_along_axis(t_en, idx, axis=1)
        B = ids.shape[0]
        style = mx.broadcast_to(styles[:, None, :S], (B, T, S))
        features = mx.concatenate(
            [asr, f0.reshape(B, T, 2), energy.reshape(B, T, 2), style], axis=-1
        )
        return features * mask, frames

    def decode(
        self,
        features: mx.array,
        frames: np.ndarray,
        seed: int | None = None,
        noise: bool = True,
        pause: Callable[[], None] | None = None,
    ) -> mx.array:
        """Audio [B, T * samples_per_frame] at 24 kHz of stacked `prepare` outputs; item
        b's samples past frames[b] * samples_per_frame are zeros.

        The excitation's additive noise (Kokoro's SineGen) is drawn per item from `seed`
        and the item's own length: with the same seed an item's audio is the same alone
        or in any batch. seed None draws a fresh one; noise=False leaves the noise out,
        as the ONNX export does (deterministic). `pause`, if given, is called between
        the decoder's blocks and the generator's, each evaluated first (`give_way`).
        """
        frames = np.asarray(frames, dtype=np.int64)
        B, T, _ = features.shape
        D, S = self.args.hidden_dim, self.args.style_dim
        mask, _ = _frame_mask(frames, T)
        features = features * mask
        asr = features[..., :D]
        f0 = features[..., D : D + 2].reshape(B, 2 * T)
        energy = features[..., D + 2 : D + 4].reshape(B, 2 * T)
        s = features[:, 0, -S:]
        key = None
        if noise:
            key = mx.random.key(int(np.random.randint(2**31)) if seed is None else seed)
        audio = self.decoder(asr, f0, energy, s, frames, key, pause)
        return audio * _frame_mask(frames * self.samples_per_frame, audio.shape[1])[0][..., 0]


def _expand_index(dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Frame -> phoneme index per item (monotonic alignment); padding frames point at 0.
    frames = np.maximum(dur.sum(axis=1), 1)
    index = np.zeros((dur.shape[0], int(frames.max())), dtype=np.int32)
    for b, row in enumerate(dur):
        rep = np.repeat(np.arange(row.shape[0], dtype=np.int32), row)
        index[b, : rep.shape[0]] = rep
    return frames, index


def style_for(voice: np.ndarray, phonemes: int) -> np.ndarray:
    """The voice's style row for a sequence of `phonemes` ids (without the two pads)."""
    return np.asarray(voice[min(phonemes, voice.shape[0] - 1)], dtype=np.float32)


def load(model_dir: Path | str) -> tuple[Model, dict]:
    """The model (eval mode) and its config (with `vocab`) from a converted directory."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "kokoro":
        raise ValueError(f"{model_dir}: model_type {config.get('model_type')!r} is not kokoro")
    model = Model(ModelArgs.from_dict(config))
    model.load_weights(str(model_dir / "model.safetensors"), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model, config


def load_voices(model_dir: Path | str) -> dict[str, np.ndarray]:
    """Voice name -> its (510, 256) float32 style table."""
    arrays = mx.load(str(Path(model_dir) / "voices.safetensors"))
    assert isinstance(arrays, dict)
    return {name: np.array(v, dtype=np.float32) for name, v in sorted(arrays.items())}
