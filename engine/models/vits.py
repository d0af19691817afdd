"""VITS as exported by Piper, on MLX: text encoder, stochastic duration predictor
(reverse), residual coupling flows, HiFi-GAN. Layout is (batch, time, channels).

Weights come from `engine.models.piper_onnx.convert`. Batches are exact: every conv of
the decoder sees zeros past its own item's end, as a lone item does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.models import fast_ops
from engine.native import kernels

__all__ = ["ModelArgs", "Model", "load", "rational_quadratic_inverse"]

Array = TypeVar("Array", mx.array, np.ndarray)


@dataclass
class ModelArgs:
    num_symbols: int = 256
    hidden_channels: int = 192
    inter_channels: int = 192
    filter_channels: int = 768
    n_heads: int = 2
    n_layers: int = 6
    kernel_size: int = 3
    window_size: int = 4
    dp_filter_channels: int = 192
    dp_kernel_size: int = 3
    dp_n_flows: int = 3
    dp_num_bins: int = 10
    dp_tail_bound: float = 5.0
    flow_n_flows: int = 4
    flow_kernel_size: int = 5
    flow_n_layers: int = 4
    resblock: str = "2"
    resblock_kernel_sizes: list[int] = field(default_factory=lambda: [3, 5, 7])
    resblock_dilation_sizes: list[list[int]] = field(
        default_factory=lambda: [[1, 2], [2, 6], [3, 12]]
    )
    upsample_rates: list[int] = field(default_factory=lambda: [8, 8, 4])
    upsample_kernel_sizes: list[int] = field(default_factory=lambda: [16, 16, 8])
    upsample_initial_channel: int = 256
    sample_rate: int = 22050
    noise_scale: float = 0.667
    length_scale: float = 1.0
    noise_w: float = 0.8
    model_type: str = "vits"

    @classmethod
    def from_dict(cls, params: dict) -> ModelArgs:
        return cls(**{k: v for k, v in params.items() if k in cls.__dataclass_fields__})

    @property
    def hop_length(self) -> int:
        return int(np.prod(self.upsample_rates))


def give_way(x: mx.array, pause: Callable[[], None] | None) -> None:
    """A render takes a while on a CPU: between its pieces, with `x` evaluated, `pause`
    may hold this thread while an urgent request of another lane runs
    (`engine.runtime.urgency`)."""
    if pause is not None:
        mx.eval(x)
        pause()


# --- convolutions --------------------------------------------------------------------


def _dilated_polyphase(x: mx.array, w: mx.array, dilation: int) -> mx.array:
    # A dilation-d conv is d undilated convs over the d interleaved phases of the input;
    # MLX's CPU conv is ~17x slower dilated than undilated.
    B, L, C = x.shape
    K = w.shape[1]
    out_len = L - (K - 1) * dilation
    n = -(-L // dilation)
    x = mx.pad(x, [(0, 0), (0, n * dilation - L), (0, 0)])
    x = x.reshape(B, n, dilation, C).transpose(0, 2, 1, 3).reshape(B * dilation, n, C)
    y = mx.conv1d(x, w)
    m = y.shape[1]
    y = y.reshape(B, dilation, m, -1).transpose(0, 2, 1, 3).reshape(B, m * dilation, -1)
    return y[:, :out_len]


CONV_MODES = ("stock", "polyphase", "taps", "native")


class Conv1d(nn.Module):
    """Same-padded conv with PyTorch's padding rule.

    `mode` picks the kernel: "stock" is `mx.conv1d`; "polyphase" runs dilated convs as
    undilated ones over interleaved phases; "taps" (default) accumulates one GEMM per
    tap into the output with `addmm`, which on the CPU beats `mx.conv1d` for narrow or
    dilated convs, and takes an optional residual for free.
    """

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        kernel: int,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.weight = mx.zeros((out_ch, kernel, in_ch // groups))
        if bias:
            self.bias = mx.zeros((out_ch,))
        self.dilation = dilation
        self.groups = groups
        self.pad = (kernel * dilation - dilation) // 2
        self.mode = "taps"
        object.__setattr__(self, "_taps", None)
        object.__setattr__(self, "_packed", None)

    def _tap_weights(self) -> list[mx.array]:
        # (in, out) matrices per tap, rebuilt only when the weight array is replaced.
        cached = self._taps
        if cached is None or cached[0] is not self.weight:
            taps = [mx.contiguous(self.weight[:, k, :].T) for k in range(self.weight.shape[1])]
            cached = (self.weight, taps)
            object.__setattr__(self, "_taps", cached)
        return cached[1]

    def _use_taps(self) -> bool:
        narrow = self.weight.shape[2] <= 64 or self.dilation > 1
        return self.mode == "taps" and self.groups == 1 and narrow

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        K = self.weight.shape[1]
        if K == 1 and self.groups == 1:
            y = x @ self.weight[:, 0, :].T
        elif self._use_taps():
            return self._tap_sum(x, residual)
        else:
            x = mx.pad(x, [(0, 0), (self.pad, self.pad), (0, 0)]) if self.pad else x
            if self.mode == "polyphase" and self.dilation > 1 and self.groups == 1:
                y = _dilated_polyphase(x, self.weight, self.dilation)
            else:
                y = mx.conv1d(x, self.weight, dilation=self.dilation, groups=self.groups)
        y = y + self.bias if "bias" in self else y
        return y if residual is None else y + residual

    def _tap_sum(self, x: mx.array, residual: mx.array | None) -> mx.array:
        B, L, _ = x.shape
        d = self.dilation
        xp = mx.pad(x, [(0, 0), (self.pad, self.pad), (0, 0)]) if self.pad else x
        taps = self._tap_weights()
        if taps[0].shape[1] == 1:
            return self._single_output(xp, L, residual)
        y = mx.zeros((B, L, taps[0].shape[1])) if residual is None else residual
        if "bias" in self:
            y = y + self.bias
        for k, w in enumerate(taps):
            y = mx.addmm(y, xp[:, k * d : k * d + L], w)
        return y

    def native(
        self,
        x: np.ndarray,
        residual: np.ndarray | None = None,
        out: np.ndarray | None = None,
        slope: float = 1.0,
    ) -> np.ndarray:
        """The same conv of leaky_relu(x, slope) (1: none) for one item, x (time, in),
        through the native kernel (`engine.native.kernels`); `out` may be `residual`
        (in place). A depthwise conv (the duration predictor's) takes x alone."""
        if self.groups > 1:
            if residual is not None or out is not None or slope != 1.0:
                raise ValueError("a native depthwise conv takes no residual, out or slope")
            return self._native_depthwise(x)
        taps, bias = self.native_weights()
        y = kernels.conv1d(
            x,
            taps,
            length=x.shape[0],
            pad_left=self.pad,
            dilation=self.dilation,
            bias=bias,
            residual=residual,
            slope=slope,
            out=out,
        )
        out_ch = self.weight.shape[0]
        return y if y.shape[1] == out_ch else y[:, :out_ch]

    def _native_depthwise(self, x: np.ndarray) -> np.ndarray:
        # One channel per group: a product per tap, no GEMM to run.
        if not self.groups == x.shape[1] == self.weight.shape[0]:
            raise ValueError("native grouped convs are depthwise only")
        L, d = x.shape[0], self.dilation
        w = np.array(self.weight[:, :, 0])
        padded = np.pad(x, ((self.pad, self.pad), (0, 0)))
        y = padded[:L] * w[:, 0]
        for k in range(1, w.shape[1]):
            y += padded[k * d : k * d + L] * w[:, k]
        return y + np.array(self.bias) if "bias" in self else y

    def native_weights(self) -> tuple[np.ndarray, np.ndarray | None]:
        # Packed for the kernel, rebuilt only when the weight array is replaced.
        cached = self._packed
        if cached is None or cached[0] is not self.weight:
            taps = kernels.pack_taps(np.array(self.weight))
            bias = kernels.padded_bias(np.array(self.bias), taps) if "bias" in self else None
            cached = (self.weight, taps, bias)
            object.__setattr__(self, "_packed", cached)
        return cached[1], cached[2]

    def _single_output(self, xp: mx.array, L: int, residual: mx.array | None) -> mx.array:
        # One output channel: a GEMM per tap would be a matrix-vector product; do one
        # GEMM for all taps and add the shifted columns instead.
        d = self.dilation
        cols = xp @ mx.concatenate(self._tap_weights(), axis=1)
        shifted = [cols[:, k * d : k * d + L, k : k + 1] for k in range(cols.shape[-1])]
        y = sum(shifted[1:], shifted[0])
        if "bias" in self:
            y = y + self.bias
        return y if residual is None else y + residual


class ConvTranspose1d(nn.Module):
    """PyTorch-equivalent transposed conv (weight stored as (out, kernel, in)).

    The rewritten paths compute all `stride` output phases as one short undilated conv
    with stride*out channels (polyphase) instead of convolving a zero-stuffed input; in
    "taps" mode that conv is one `addmm` per tap.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int, padding: int) -> None:
        super().__init__()
        self.weight = mx.zeros((out_ch, kernel, in_ch))
        self.bias = mx.zeros((out_ch,))
        self.stride = stride
        self.padding = padding
        self.mode = "taps"
        # Derived from `weight` on first use; kept off the parameter tree.
        object.__setattr__(self, "_poly", None)
        object.__setattr__(self, "_packed", None)

    def _polyphase_weight(self) -> tuple[mx.array, list[mx.array], int, int]:
        # Output t = m*s + r takes input m - e through tap k = q + e*s, q = r + padding.
        cached = self._poly
        if cached is None or cached[0] is not self.weight:
            w = np.array(self.weight)
            O, K, Ci = w.shape
            s, p = self.stride, self.padding
            taps = [(r, e, r + p + e * s) for r in range(s) for e in range(-K, K + 1)]
            taps = [(r, e, k) for r, e, k in taps if 0 <= k < K]
            e_max = max(e for _, e, _ in taps)
            e_min = min(e for _, e, _ in taps)
            poly = np.zeros((s, O, e_max - e_min + 1, Ci), dtype=np.float32)
            for r, e, k in taps:
                poly[r, :, e_max - e] = w[:, k, :]
            phases = poly.reshape(s * O, -1, Ci)
            per_tap = [
                mx.array(np.ascontiguousarray(phases[:, u, :].T)) for u in range(phases.shape[1])
            ]
            cached = (self.weight, mx.array(phases), per_tap, e_max, e_min)
            object.__setattr__(self, "_poly", cached)
        return cached[1:]

    def __call__(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        s = self.stride
        out_len = (L - 1) * s - 2 * self.padding + self.weight.shape[1]
        if self.mode == "stock":
            y = mx.conv_transpose1d(x, self.weight, stride=s, padding=self.padding)
            return y + self.bias
        w, per_tap, e_max, e_min = self._polyphase_weight()
        m = -(-out_len // s)
        right = max(0, m - 1 - e_min - (L - 1))
        xp = mx.pad(x, [(0, 0), (e_max, right), (0, 0)])
        if self.mode == "taps":
            y = mx.zeros((B, m, w.shape[0])) + mx.tile(self.bias, s)
            for u, wu in enumerate(per_tap):
                y = mx.addmm(y, xp[:, u : u + m], wu)
            return y.reshape(B, m * s, -1)[:, :out_len]
        y = mx.conv1d(xp, w)[:, :m]
        y = y.reshape(B, m * s, -1)[:, :out_len]
        return y + self.bias

    def native(self, x: np.ndarray, slope: float) -> np.ndarray:
        """The same transposed conv of leaky_relu(x, slope) for one item, x (time, in),
        through the native kernel: its polyphase conv, one call."""
        s, L = self.stride, x.shape[0]
        out_len = (L - 1) * s - 2 * self.padding + self.weight.shape[1]
        _, per_tap, e_max, _ = self._polyphase_weight()
        cached = self._packed
        if cached is None or cached[0] is not per_tap:
            # per_tap: (in, stride * out) per tap; the kernel's blocks of (out, taps, in).
            taps = kernels.pack_taps(np.stack([np.array(w).T for w in per_tap], axis=1))
            bias = np.tile(np.array(self.bias), s).astype(np.float32)
            cached = (per_tap, taps, bias)
            object.__setattr__(self, "_packed", cached)
        m = -(-out_len // s)
        y = kernels.conv1d(x, cached[1], length=m, pad_left=e_max, bias=cached[2], slope=slope)
        return y.reshape(m * s, -1)[:out_len]


class LayerNorm(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = mx.ones((channels,))
        self.beta = mx.zeros((channels,))

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.layer_norm(x, self.gamma, self.beta, 1e-5)

    def native(
        self, x: np.ndarray, residual: np.ndarray | None = None, gelu: bool = False
    ) -> np.ndarray:
        """The norm of x + residual (time, channels), then the GELU where `gelu`, in
        one native pass."""
        gamma, beta = np.array(self.gamma), np.array(self.beta)
        return kernels.layer_norm(x, gamma, beta, residual, gelu, 1e-5)


# --- text encoder --------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    def __init__(self, channels: int, n_heads: int, window_size: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.window = window_size
        self.conv_q = Conv1d(channels, channels, 1)
        self.conv_k = Conv1d(channels, channels, 1)
        self.conv_v = Conv1d(channels, channels, 1)
        self.conv_o = Conv1d(channels, channels, 1)
        d = channels // n_heads
        self.emb_rel_k = mx.zeros((1, 2 * window_size + 1, d))
        self.emb_rel_v = mx.zeros((1, 2 * window_size + 1, d))

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        B, L, C = x.shape
        H, W = self.n_heads, self.window
        q, k, v = (
            c(x).reshape(B, L, H, -1).transpose(0, 2, 1, 3)
            for c in (self.conv_q, self.conv_k, self.conv_v)
        )
        q = q / math.sqrt(q.shape[-1])
        # Relative offset j - i in [-W, W] indexes the shared embeddings; beyond, zero.
        offset = mx.arange(L)[None, :] - mx.arange(L)[:, None]
        near = mx.abs(offset) <= W
        rel_idx = mx.clip(offset + W, 0, 2 * W)
        rel_logits = q @ self.emb_rel_k[0].T
        local = mx.take_along_axis(rel_logits, mx.broadcast_to(rel_idx, (B, H, L, L)), axis=-1)
        scores = q @ k.transpose(0, 1, 3, 2) + mx.where(near, local, 0.0)
        scores = mx.where(mask, scores, -1e4)
        p = fast_ops.softmax(scores)
        out = p @ v
        # p at offsets -W..W per query, as weights for the value embeddings.
        col = mx.arange(L)[:, None] + mx.arange(-W, W + 1)[None, :]
        valid = (col >= 0) & (col < L)
        rel_p = mx.take_along_axis(
            p, mx.broadcast_to(mx.clip(col, 0, L - 1), (B, H, L, 2 * W + 1)), -1
        )
        out = out + mx.where(valid, rel_p, 0.0) @ self.emb_rel_v[0]
        return self.conv_o(out.transpose(0, 2, 1, 3).reshape(B, L, C))

    def native(self, x: np.ndarray) -> np.ndarray:
        """The same over one item, x (time, channels), with nothing masked, one head at
        a time: the native kernel for the products, NumPy for the rest."""
        L, C = x.shape
        H, W = self.n_heads, self.window
        q, k, v = (
            c.native(x).reshape(L, H, -1).transpose(1, 0, 2)
            for c in (self.conv_q, self.conv_k, self.conv_v)
        )
        q = q / math.sqrt(q.shape[-1])
        # The scores (H, L, L) at offsets -W..W of the diagonal, flat, against the same
        # (query, offset) pairs of (H, L, 2W + 1); pairs past either end are left out.
        key = np.arange(L)[:, None] + np.arange(-W, W + 1)
        query, offset = np.nonzero((key >= 0) & (key < L))
        at, rel = query * L + key[query, offset], query * (2 * W + 1) + offset
        rel_k, rel_v = np.array(self.emb_rel_k[0]), np.array(self.emb_rel_v[0])
        out = np.empty((L, H, q.shape[-1]), np.float32)
        for h in range(H):
            scores = kernels.matmul(q[h], k[h].T)
            scores.reshape(-1)[at] += kernels.matmul(q[h], rel_k.T).reshape(-1)[rel]
            p = kernels.softmax(scores)
            rel_p = np.zeros(L * (2 * W + 1), np.float32)
            rel_p[rel] = p.reshape(-1)[at]
            out[:, h] = kernels.matmul(p, v[h]) + kernels.matmul(rel_p.reshape(L, -1), rel_v)
        return self.conv_o.native(out.reshape(L, C))


class FFN(nn.Module):
    def __init__(self, channels: int, filter_channels: int, kernel: int) -> None:
        super().__init__()
        self.conv_1 = Conv1d(channels, filter_channels, kernel)
        self.conv_2 = Conv1d(filter_channels, channels, kernel)

    def __call__(self, x: mx.array, x_mask: mx.array) -> mx.array:
        x = nn.relu(self.conv_1(x * x_mask))
        return self.conv_2(x * x_mask) * x_mask

    def native(self, x: np.ndarray) -> np.ndarray:
        """The same over one item, x (time, channels); the ReLU is conv_2's input
        activation."""
        return self.conv_2.native(self.conv_1.native(x), slope=0.0)


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        C = args.hidden_channels
        self.attn_layers = [
            MultiHeadAttention(C, args.n_heads, args.window_size) for _ in range(args.n_layers)
        ]
        self.norm_layers_1 = [LayerNorm(C) for _ in range(args.n_layers)]
        self.ffn_layers = [
            FFN(C, args.filter_channels, args.kernel_size) for _ in range(args.n_layers)
        ]
        self.norm_layers_2 = [LayerNorm(C) for _ in range(args.n_layers)]

    def __call__(self, x: mx.array, x_mask: mx.array) -> mx.array:
        attn_mask = (x_mask[:, None, :, 0:1] * x_mask[:, None, None, :, 0]) > 0
        x = x * x_mask
        for attn, n1, ffn, n2 in zip(
            self.attn_layers, self.norm_layers_1, self.ffn_layers, self.norm_layers_2, strict=True
        ):
            x = n1(x + attn(x, attn_mask))
            x = n2(x + ffn(x, x_mask))
        return x * x_mask

    def native(self, x: np.ndarray) -> np.ndarray:
        """The same over one item, x (time, channels), with nothing masked."""
        for attn, n1, ffn, n2 in zip(
            self.attn_layers, self.norm_layers_1, self.ffn_layers, self.norm_layers_2, strict=True
        ):
            x = n1.native(attn.native(x), residual=x)
            x = n2.native(ffn.native(x), residual=x)
        return x


class TextEncoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.hidden = args.hidden_channels
        self.emb = nn.Embedding(args.num_symbols, args.hidden_channels)
        self.encoder = Encoder(args)
        self.proj = Conv1d(args.hidden_channels, 2 * args.inter_channels, 1)

    def __call__(self, ids: mx.array, x_mask: mx.array) -> tuple[mx.array, ...]:
        x = self.emb(ids) * math.sqrt(self.hidden)
        x = self.encoder(x, x_mask)
        m, logs = mx.split(self.proj(x) * x_mask, 2, axis=-1)
        return x, m, logs

    def native(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """The same for one item's ids (time,), through the native kernels."""
        x = np.array(self.emb.weight)[ids] * math.sqrt(self.hidden)
        x = self.encoder.native(x)
        m, logs = np.split(self.proj.native(x), 2, axis=-1)
        return x, m, logs


# --- stochastic duration predictor ---------------------------------------------------


def rational_quadratic_inverse(
    y: Array,
    widths: Array,
    heights: Array,
    derivs: Array,
    tail_bound: float,
    min_bin: float = 1e-3,
    min_deriv: float = 1e-3,
    xp: ModuleType = mx,
) -> Array:
    """Inverse of the monotone rational-quadratic spline on [-B, B], identity outside.

    `derivs` holds the num_bins - 1 inner knot derivatives (pre-softplus); the two edge
    derivatives are 1 so the spline joins the identity tails smoothly. `xp` is the
    arrays' module: `mlx.core`, or `numpy` for the native path.
    """
    n = widths.shape[-1]
    B = tail_bound

    def knots(unnormalised: Array) -> tuple[Array, Array]:
        e = xp.exp(unnormalised - xp.max(unnormalised, axis=-1, keepdims=True))
        size = min_bin + (1 - min_bin * n) * (e / xp.sum(e, axis=-1, keepdims=True))
        cum = xp.cumsum(size, axis=-1)
        cum = xp.concatenate([xp.zeros_like(cum[..., :1]), cum], axis=-1)
        cum = 2 * B * cum - B
        cum = xp.concatenate([cum[..., :1] * 0 - B, cum[..., 1:-1], cum[..., :1] * 0 + B], -1)
        return cum, cum[..., 1:] - cum[..., :-1]

    cumw, w = knots(widths)
    cumh, h = knots(heights)
    edge = xp.ones_like(derivs[..., :1]) * (1.0 - min_deriv)
    d = min_deriv + xp.concatenate([edge, xp.logaddexp(derivs, 0.0), edge], axis=-1)

    inside = (y >= -B) & (y <= B)
    yc = xp.clip(y, -B, B)
    # Bin whose height interval holds y (last knot nudged so y == B lands in the last bin).
    upper = xp.concatenate([cumh[..., :-1], cumh[..., -1:] + 1e-6], axis=-1)
    idx = xp.clip(xp.sum(yc[..., None] >= upper, axis=-1, keepdims=True) - 1, 0, n - 1)

    def pick(a: Array) -> Array:
        return xp.take_along_axis(a, idx, axis=-1)[..., 0]

    x_k, w_k, y_k, h_k = pick(cumw), pick(w), pick(cumh), pick(h)
    d_k, d_k1 = pick(d[..., :-1]), pick(d[..., 1:])
    s_k = h_k / w_k
    # Solve a*xi^2 + b*xi + c = 0 for xi in [0, 1] (Durkan et al. 2019, eq. 6-8).
    dy = yc - y_k
    slope_sum = d_k + d_k1 - 2 * s_k
    a = h_k * (s_k - d_k) + dy * slope_sum
    b = h_k * d_k - dy * slope_sum
    c = -s_k * dy
    disc = xp.maximum(b * b - 4 * a * c, 0.0)
    xi = (2 * c) / (-b - xp.sqrt(disc))
    return xp.where(inside, xi * w_k + x_k, y)  # type: ignore[no-any-return]


class DDSConv(nn.Module):
    def __init__(self, channels: int, kernel: int, n_layers: int) -> None:
        super().__init__()
        self.convs_sep = [
            Conv1d(channels, channels, kernel, dilation=kernel**i, groups=channels)
            for i in range(n_layers)
        ]
        self.convs_1x1 = [Conv1d(channels, channels, 1) for _ in range(n_layers)]
        self.norms_1 = [LayerNorm(channels) for _ in range(n_layers)]
        self.norms_2 = [LayerNorm(channels) for _ in range(n_layers)]

    def __call__(self, x: mx.array, x_mask: mx.array, g: mx.array | None = None) -> mx.array:
        if g is not None:
            x = x + g
        for sep, c1, n1, n2 in zip(
            self.convs_sep, self.convs_1x1, self.norms_1, self.norms_2, strict=True
        ):
            y = fast_ops.gelu(n1(sep(x * x_mask)))
            y = fast_ops.gelu(n2(c1(y)))
            x = x + y
        return x * x_mask

    def native(self, x: np.ndarray, g: np.ndarray | None = None) -> np.ndarray:
        """The same over one item, x (time, channels), with nothing masked."""
        if g is not None:
            x = x + g
        for sep, c1, n1, n2 in zip(
            self.convs_sep, self.convs_1x1, self.norms_1, self.norms_2, strict=True
        ):
            y = n1.native(sep.native(x), gelu=True)
            x = x + n2.native(c1.native(y), gelu=True)
        return x


class ConvFlow(nn.Module):
    def __init__(self, filter_channels: int, kernel: int, num_bins: int, tail_bound: float):
        super().__init__()
        self.filter_channels = filter_channels
        self.num_bins = num_bins
        self.tail_bound = tail_bound
        self.pre = Conv1d(1, filter_channels, 1)
        self.convs = DDSConv(filter_channels, kernel, 3)
        self.proj = Conv1d(filter_channels, 3 * num_bins - 1, 1)

    def __call__(self, x: mx.array, x_mask: mx.array, g: mx.array) -> mx.array:
        x0, x1 = x[..., :1], x[..., 1:]
        h = self.convs(self.pre(x0), x_mask, g)
        h = self.proj(h) * x_mask
        n, scale = self.num_bins, math.sqrt(self.filter_channels)
        x1 = rational_quadratic_inverse(
            x1[..., 0],
            h[..., :n] / scale,
            h[..., n : 2 * n] / scale,
            h[..., 2 * n :],
            self.tail_bound,
        )[..., None]
        return mx.concatenate([x0, x1], axis=-1) * x_mask

    def native(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        """The same over one item, x (time, 2), with nothing masked."""
        x0, x1 = x[:, :1], x[:, 1]
        h = self.proj.native(self.convs.native(self.pre.native(x0), g))
        n, scale = self.num_bins, math.sqrt(self.filter_channels)
        widths, heights, derivs = h[:, :n] / scale, h[:, n : 2 * n] / scale, h[:, 2 * n :]
        x1 = rational_quadratic_inverse(x1, widths, heights, derivs, self.tail_bound, xp=np)
        return np.stack([x0[:, 0], x1], axis=1)


class ElementwiseAffine(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.m = mx.zeros((channels, 1))
        self.logs = mx.zeros((channels, 1))

    def __call__(self, x: mx.array, x_mask: mx.array, g: mx.array | None = None) -> mx.array:
        return (x - self.m[:, 0]) * mx.exp(-self.logs[:, 0]) * x_mask

    def native(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return (x - np.array(self.m[:, 0])) * np.exp(-np.array(self.logs[:, 0]))


class Flip(nn.Module):
    def __call__(self, x: mx.array, x_mask: mx.array, g: mx.array | None = None) -> mx.array:
        return x[..., ::-1]


class UnusedFlow(nn.Module):
    """Training-only flow that inference skips; holds the slot so indices match."""


class DurationPredictor(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        F = args.dp_filter_channels
        self.pre = Conv1d(args.hidden_channels, F, 1)
        self.convs = DDSConv(F, args.dp_kernel_size, 3)
        self.proj = Conv1d(F, F, 1)
        flow = (F, args.dp_kernel_size, args.dp_num_bins, args.dp_tail_bound)
        self.flows = [ElementwiseAffine(2), UnusedFlow(), Flip()]
        for _ in range(args.dp_n_flows):
            self.flows += [ConvFlow(*flow), Flip()]

    def __call__(self, x: mx.array, x_mask: mx.array, noise: mx.array) -> mx.array:
        g = self.proj(self.convs(self.pre(x), x_mask)) * x_mask
        z = noise
        for flow in [f for f in reversed(self.flows) if not isinstance(f, UnusedFlow)]:
            z = flow(z, x_mask, g)
        return z[..., :1]

    def native(self, x: np.ndarray, noise: np.ndarray) -> np.ndarray:
        """The same over one item, x (time, hidden) and noise (time, 2), through the
        native kernels."""
        g = self.proj.native(self.convs.native(self.pre.native(x)))
        z = noise
        for flow in reversed(self.flows):
            if isinstance(flow, Flip):
                z = z[:, ::-1]
            elif not isinstance(flow, UnusedFlow):
                z = flow.native(z, g)
        return z[:, :1]


# --- flows ---------------------------------------------------------------------------


class WN(nn.Module):
    def __init__(self, hidden: int, kernel: int, n_layers: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.in_layers = [Conv1d(hidden, 2 * hidden, kernel) for _ in range(n_layers)]
        self.res_skip_layers = [
            Conv1d(hidden, 2 * hidden if i < n_layers - 1 else hidden, 1) for i in range(n_layers)
        ]

    def __call__(self, x: mx.array, x_mask: mx.array) -> mx.array:
        H = self.hidden
        out = mx.zeros_like(x)
        last = len(self.in_layers) - 1
        for i, (cin, cres) in enumerate(zip(self.in_layers, self.res_skip_layers, strict=True)):
            a = cin(x)
            acts = fast_ops.tanh(a[..., :H]) * fast_ops.sigmoid(a[..., H:])
            rs = cres(acts)
            if i < last:
                x = (x + rs[..., :H]) * x_mask
                out = out + rs[..., H:]
            else:
                out = out + rs
        return out * x_mask

    def native(self, x: np.ndarray) -> np.ndarray:
        """The same over one item, x (time, hidden), through the native kernels; the
        layers' running input and skip sum side by side in one array, so that each
        res/skip conv adds onto both in place."""
        H = self.hidden
        state = np.concatenate([x, np.zeros_like(x)], axis=1)  # [input | skip sum]
        last = len(self.in_layers) - 1
        for i, (cin, cres) in enumerate(zip(self.in_layers, self.res_skip_layers, strict=True)):
            acts = kernels.gate(cin.native(state[:, :H]))
            if i < last:
                cres.native(acts, residual=state, out=state)
            else:
                return state[:, H:] + cres.native(acts)
        raise AssertionError("WN has layers")


class ResidualCouplingLayer(nn.Module):
    def __init__(self, channels: int, hidden: int, kernel: int, n_layers: int) -> None:
        super().__init__()
        self.half = channels // 2
        self.pre = Conv1d(self.half, hidden, 1)
        self.enc = WN(hidden, kernel, n_layers)
        self.post = Conv1d(hidden, self.half, 1)

    def __call__(self, x: mx.array, x_mask: mx.array) -> mx.array:
        x0, x1 = x[..., : self.half], x[..., self.half :]
        h = self.enc(self.pre(x0) * x_mask, x_mask)
        m = self.post(h) * x_mask
        return mx.concatenate([x0, (x1 - m) * x_mask], axis=-1)

    def native(self, x: np.ndarray) -> np.ndarray:
        """The same over one item, x (time, channels), through the native kernels."""
        x0, x1 = x[:, : self.half], x[:, self.half :]
        m = self.post.native(self.enc.native(self.pre.native(x0)))
        return np.concatenate([x0, x1 - m], axis=1)


class CouplingFlows(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.flows = []
        for _ in range(args.flow_n_flows):
            self.flows += [
                ResidualCouplingLayer(
                    args.inter_channels,
                    args.hidden_channels,
                    args.flow_kernel_size,
                    args.flow_n_layers,
                ),
                Flip(),
            ]

    def __call__(self, x: mx.array, x_mask: mx.array) -> mx.array:
        for flow in reversed(self.flows):
            x = flow(x, x_mask)
        return x

    def native(self, x: np.ndarray) -> np.ndarray:
        """The same over one item, x (time, channels), through the native kernels."""
        for flow in reversed(self.flows):
            x = x[:, ::-1] if isinstance(flow, Flip) else flow.native(x)
        return x


# --- HiFi-GAN ------------------------------------------------------------------------


def _masked(x: mx.array, mask: mx.array | None) -> mx.array:
    return x if mask is None else x * mask


class ResBlock(nn.Module):
    """Resblock "2" (one dilated conv per step) or "1" (dilated conv, then undilated)."""

    def __init__(self, channels: int, kernel: int, dilations: list[int], kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "1":
            self.convs1 = [Conv1d(channels, channels, kernel, dilation=d) for d in dilations]
            self.convs2 = [Conv1d(channels, channels, kernel) for _ in dilations]
        else:
            self.convs = [Conv1d(channels, channels, kernel, dilation=d) for d in dilations]

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        if self.kind == "1":
            for c1, c2 in zip(self.convs1, self.convs2, strict=True):
                xt = c1(_masked(nn.leaky_relu(x, 0.1), mask))
                x = c2(_masked(nn.leaky_relu(xt, 0.1), mask), residual=x)
            return x
        for c in self.convs:
            x = c(_masked(nn.leaky_relu(x, 0.1), mask), residual=x)
        return x

    def native_convs(self) -> list[kernels.Conv]:
        """The block's convs as the native kernel takes them, in the order they run."""
        convs = (
            self.convs
            if self.kind == "2"
            else [c for pair in zip(self.convs1, self.convs2, strict=True) for c in pair]
        )
        return [kernels.Conv(*c.native_weights(), c.dilation) for c in convs]


def _stage_radius(sizes: list[int], dilations: list[list[int]], kind: str) -> int:
    # Samples on each side that one stage of parallel resblocks reads beyond its output.
    def radius(k: int, ds: list[int]) -> int:
        r = sum((k - 1) // 2 * d for d in ds)
        return r + (k - 1) // 2 * len(ds) if kind == "1" else r

    return max(radius(k, ds) for k, ds in zip(sizes, dilations, strict=True))


class Generator(nn.Module):
    """HiFi-GAN. On the CPU each stage's resblocks run over time tiles of about 1 MiB
    (plus a halo of the stage's receptive radius, so results are unchanged): the
    narrow convs then work from cache instead of memory, about twice as fast."""

    TILE_BYTES = 1 << 20
    MIN_TILE = 1024

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        C = args.upsample_initial_channel
        self.conv_pre = Conv1d(args.inter_channels, C, 7)
        self.ups = []
        self.resblocks = []
        for i, (u, k) in enumerate(
            zip(args.upsample_rates, args.upsample_kernel_sizes, strict=True)
        ):
            self.ups.append(ConvTranspose1d(C >> i, C >> (i + 1), k, u, (k - u) // 2))
            for rk, rd in zip(
                args.resblock_kernel_sizes, args.resblock_dilation_sizes, strict=True
            ):
                self.resblocks.append(ResBlock(C >> (i + 1), rk, rd, args.resblock))
        self.conv_post = Conv1d(C >> len(self.ups), 1, 7, bias=False)
        self.rates = args.upsample_rates
        self.n_kernels = len(args.resblock_kernel_sizes)
        self.radius = _stage_radius(
            args.resblock_kernel_sizes, args.resblock_dilation_sizes, args.resblock
        )
        self.tiled = True
        # Run on the CPU through `engine.native.kernels` (`Model.set_conv_mode`).
        self.native = False

    def _stage(self, i: int, x: mx.array, mask: mx.array | None) -> mx.array:
        blocks = self.resblocks[i * self.n_kernels : (i + 1) * self.n_kernels]
        xs = blocks[0](x, mask)
        for block in blocks[1:]:
            xs = xs + block(x, mask)
        x = xs / self.n_kernels
        if i == len(self.ups) - 1:
            x = fast_ops.tanh(self.conv_post(_masked(nn.leaky_relu(x, 0.01), mask)))
        return x

    def _run_stage(
        self, i: int, x: mx.array, mask: mx.array | None, pause: Callable[[], None] | None
    ) -> mx.array:
        B, length, C = x.shape
        tile = max(self.MIN_TILE, self.TILE_BYTES // (4 * C * B))
        halo = self.radius + (3 if i == len(self.ups) - 1 else 0)
        on_cpu = mx.default_device() == mx.cpu
        if not (self.tiled and on_cpu) or length <= tile + 2 * halo:
            return self._stage(i, x, mask)
        outs = []
        for start in range(0, length, tile):
            a, b = max(0, start - halo), min(length, start + tile + halo)
            part = self._stage(i, x[:, a:b], None if mask is None else mask[:, a:b])
            part = part[:, start - a : start - a + min(tile, length - start)]
            mx.eval(part)  # finish this tile while its activations are still in cache
            outs.append(part)
            if pause is not None and start + tile < length:
                pause()
        return mx.concatenate(outs, axis=1)

    def context_frames(self) -> int:
        # Receptive radius in input frames: conv_pre, then per upsampling stage its
        # transposed conv (in its input's units) and its resblocks (in its output's).
        radius = float(self.conv_pre.weight.shape[1] // 2)
        scale = 1
        for i, up in enumerate(self.ups):
            radius += math.ceil(up.weight.shape[1] / up.stride) / scale
            scale *= up.stride
            post = self.conv_post.weight.shape[1] // 2 if i == len(self.ups) - 1 else 0
            radius += (self.radius + post) / scale
        return math.ceil(radius)

    def __call__(
        self, x: mx.array, mask: mx.array | None, pause: Callable[[], None] | None = None
    ) -> mx.array:
        """`mask` [B, frames, 1], or None when every item fills the whole length.
        `pause`, if given, is called between the stages and between a stage's time tiles
        on the CPU, each evaluated first (`give_way`)."""
        if self.native and mx.default_device() == mx.cpu:
            return self._native(x, mask, pause)
        x = self.conv_pre(_masked(x, mask))
        for i, up in enumerate(self.ups):
            x = up(_masked(nn.leaky_relu(x, 0.1), mask))
            mask = None if mask is None else mx.repeat(mask, self.rates[i], axis=1)
            x = self._run_stage(i, x, mask, pause)
            if i < len(self.ups) - 1:
                give_way(x, pause)
        return x[..., 0]

    def _native(
        self, x: mx.array, mask: mx.array | None, pause: Callable[[], None] | None
    ) -> mx.array:
        # Item by item, each cut to its own frames: the masked batch's convs see zeros
        # past an item's end, as a lone item's do.
        B, T, _ = x.shape
        frames = [T] * B if mask is None else np.array(mask.sum(axis=(1, 2))).astype(int)
        hop = math.prod(self.rates)
        audio = np.zeros((B, T * hop), np.float32)
        for b in range(B):
            y = np.array(x[b, : int(frames[b])])
            y = self.conv_pre.native(y)
            for i, up in enumerate(self.ups):
                y = self._native_stage(i, up.native(y, slope=0.1), pause)
                if i < len(self.ups) - 1 and pause is not None:
                    pause()
            audio[b, : y.shape[0]] = self.conv_post.native(y, slope=0.01)[:, 0]
        return fast_ops.tanh(mx.array(audio))

    def _native_stage(self, i: int, x: np.ndarray, pause: Callable[[], None] | None) -> np.ndarray:
        # The tiles of `_run_stage`, for the same reason: a tile's activations stay in cache.
        length, C = x.shape
        tile = max(self.MIN_TILE, self.TILE_BYTES // (4 * C)) if self.tiled else length
        out = np.empty_like(x)
        # The tile's sum, a block's output and a pair's middle, reused tile after tile.
        work = np.empty((3, min(length, tile + 2 * self.radius), C), np.float32)
        for start in range(0, length, tile):
            a, b = max(0, start - self.radius), min(length, start + tile + self.radius)
            part = self._native_blocks(i, x[a:b], work)
            n = min(tile, length - start)
            out[start : start + n] = part[start - a : start - a + n]
            if pause is not None and start + tile < length:
                pause()
        return out

    def _native_blocks(self, i: int, x: np.ndarray, work: np.ndarray) -> np.ndarray:
        blocks = self.resblocks[i * self.n_kernels : (i + 1) * self.n_kernels]
        convs = [block.native_convs() for block in blocks]
        return kernels.resblocks(x, convs, blocks[0].kind == "1", 0.1, work)


# --- the whole voice -----------------------------------------------------------------


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.enc_p = TextEncoder(args)
        self.dp = DurationPredictor(args)
        self.flow = CouplingFlows(args)
        self.dec = Generator(args)

    def set_conv_mode(self, mode: str, tiled: bool = True) -> None:
        """Conv kernels: "native" (on the CPU, the whole voice item by item through
        `engine.native.kernels` and NumPy; elsewhere as "taps"; what `load` picks where
        it builds), "taps" (one GEMM per tap, the fastest in MLX on a CPU), "polyphase",
        or MLX's "stock"; `tiled` runs the decoder's resblocks over cache-sized time
        tiles on the CPU."""
        if mode not in CONV_MODES:
            raise ValueError(f"conv mode must be one of {CONV_MODES}")
        if mode == "native" and not kernels.load():
            raise RuntimeError("native convolutions need a C compiler (see the log)")
        for _, m in self.named_modules():
            if isinstance(m, (Conv1d, ConvTranspose1d)):
                m.mode = "taps" if mode == "native" else mode
        self.dec.tiled = tiled
        self.dec.native = mode == "native"

    def durations(
        self, ids: mx.array, lengths: mx.array, noise_w: mx.array, length_scale: mx.array
    ) -> tuple[mx.array, ...]:
        """Encoder stats and integer frame counts per phoneme ([B, L])."""
        B, L = ids.shape
        noise = mx.random.normal((B, L, 2)) * noise_w[:, None, None]
        if self._native_here():
            return self._native_durations(ids, lengths, noise, length_scale)
        x_mask = (mx.arange(L)[None, :] < lengths[:, None]).astype(mx.float32)[..., None]
        x, m_p, logs_p = self.enc_p(ids, x_mask)
        logw = self.dp(x, x_mask, noise)
        w = mx.exp(logw) * x_mask * length_scale[:, None, None]
        return m_p, logs_p, mx.ceil(w)[..., 0]

    def _native_here(self) -> bool:
        return self.dec.native and mx.default_device() == mx.cpu  # set_conv_mode("native")

    def _native_durations(
        self, ids: mx.array, lengths: mx.array, noise: mx.array, length_scale: mx.array
    ) -> tuple[mx.array, ...]:
        # Each item alone, cut to its own length, as the flows and the vocoder run.
        B, L = ids.shape
        C = self.args.inter_channels
        m_p, logs_p = np.zeros((B, L, C), np.float32), np.zeros((B, L, C), np.float32)
        dur = np.zeros((B, L), np.float32)
        noise_np, ids_np = np.array(noise), np.array(ids)
        for b, (n, scale) in enumerate(zip(np.array(lengths), np.array(length_scale), strict=True)):
            x, m_p[b, :n], logs_p[b, :n] = self.enc_p.native(ids_np[b, :n])
            logw = self.dp.native(x, noise_np[b, :n])
            dur[b, :n] = np.ceil(np.exp(logw[:, 0]) * scale)
        return mx.array(m_p), mx.array(logs_p), mx.array(dur)

    def context_frames(self) -> int:
        """Latent frames on each side that one output frame of `render` depends on.

        Rendering a window of latents with this many extra frames on each side (or up to
        the clause's own end) gives the window's middle exactly as the whole clause would.
        Of these, `dec.context_frames()` are the vocoder's: the flows' output needs only
        that many beyond the frames wanted.
        """
        a = self.args
        flows = a.flow_n_flows * a.flow_n_layers * (a.flow_kernel_size // 2)
        return flows + self.dec.context_frames()

    def latents(
        self,
        ids: mx.array,
        lengths: mx.array,
        noise_scale: float | mx.array | None = None,
        length_scale: float | mx.array | None = None,
        noise_w: float | mx.array | None = None,
    ) -> tuple[mx.array, np.ndarray]:
        """Prior latents z_p [B, frames, C] and each item's frame count.

        The three scales are scalars or one value per item; None takes the voice's own.
        """
        B = ids.shape[0]
        a = self.args
        length_scale, noise_scale, noise_w = (
            mx.broadcast_to(mx.array(default if v is None else v, dtype=mx.float32), (B,))
            for v, default in (
                (length_scale, a.length_scale),
                (noise_scale, a.noise_scale),
                (noise_w, a.noise_w),
            )
        )
        m_p, logs_p, dur = self.durations(ids, lengths, noise_w, length_scale)
        frames, index = _expand_index(np.array(dur).astype(np.int64))
        idx = mx.array(index)[..., None]
        m = mx.take_along_axis(m_p, idx, axis=1)
        logs = mx.take_along_axis(logs_p, idx, axis=1)
        z_p = m + mx.random.normal(m.shape) * mx.exp(logs) * noise_scale[:, None, None]
        return z_p, frames

    def flows(self, z_p: mx.array, frames: np.ndarray) -> mx.array:
        """Latents z [B, T, C] of prior latents; item b fills its first `frames[b]` frames."""
        if self._native_here():
            z = np.zeros(z_p.shape, np.float32)
            for b, n in enumerate(frames):  # each item alone, cut to its own frames
                z[b, :n] = self.flow.native(np.array(z_p[b, :n]))
            return mx.array(z)
        y_mask = _frame_mask(frames, z_p.shape[1])
        return self.flow(z_p * y_mask, y_mask) * y_mask

    def vocode(
        self, z: mx.array, frames: np.ndarray, pause: Callable[[], None] | None = None
    ) -> mx.array:
        """Audio [B, samples] of latents z; item b fills its first `frames[b]` frames.
        `pause`: see `Generator.__call__`."""
        T = z.shape[1]
        full = bool((frames == T).all())
        return self.dec(z, None if full else _frame_mask(frames, T), pause)

    def render(self, z_p: mx.array, frames: np.ndarray) -> mx.array:
        """Audio [B, samples] of prior latents (flows, then the vocoder)."""
        return self.vocode(self.flows(z_p, frames), frames)

    def __call__(
        self,
        ids: mx.array,
        lengths: mx.array,
        noise_scale: float | mx.array | None = None,
        length_scale: float | mx.array | None = None,
        noise_w: float | mx.array | None = None,
    ) -> tuple[mx.array, list[int]]:
        """Audio [B, samples] at the voice rate and each item's length in samples.

        The three scales are scalars or one value per item; None takes the voice's own.
        """
        z_p, frames = self.latents(ids, lengths, noise_scale, length_scale, noise_w)
        hop = self.args.hop_length
        return self.render(z_p, frames), [int(f) * hop for f in frames]


def _frame_mask(frames: np.ndarray, T: int) -> mx.array:
    return (mx.arange(T)[None, :] < mx.array(frames)[:, None]).astype(mx.float32)[..., None]


def _expand_index(dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Frame -> phoneme index per item (monotonic alignment); padding frames point at 0.
    frames = np.maximum(dur.sum(axis=1), 1)
    T = int(frames.max())
    index = np.zeros((dur.shape[0], T), dtype=np.int32)
    for b, row in enumerate(dur):
        rep = np.repeat(np.arange(row.shape[0], dtype=np.int32), row)
        index[b, : rep.shape[0]] = rep
    return frames, index


def load(model_dir: Path | str) -> tuple[Model, dict]:
    """The model and the voice's Piper json from a converted directory."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "vits":
        raise ValueError(f"{model_dir}: model_type {config.get('model_type')!r} is not vits")
    voice = json.loads((model_dir / "voice.json").read_text(encoding="utf-8"))
    model = Model(ModelArgs.from_dict(config))
    model.load_weights(str(model_dir / "model.safetensors"), strict=True)
    mx.eval(model.parameters())
    if kernels.load():
        model.set_conv_mode("native")
    return model, voice
