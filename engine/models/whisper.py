"""Whisper on MLX: log-mel front end, an encoder that runs on any number of frames, and a
decoder with a KV cache.

The encoder takes as many mel frames as the audio has (up to the 30 s window), so a short
utterance pays for its own length only. Positional embeddings are sliced to match. On the
CPU it runs item by item through the native kernels (`engine.native.kernels`) where they
build (`load_model`): MLX's CPU runs norms, GELUs and softmaxes as chains of small passes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.models import fast_ops
from engine.native import kernels

Attend = Callable[[mx.array, mx.array, mx.array, float, Any], mx.array]

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE
N_FRAMES = N_SAMPLES // HOP_LENGTH  # mel frames in the full window
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH


@dataclass
class ModelArgs:
    n_mels: int = 80
    n_audio_ctx: int = 1500
    n_audio_state: int = 384
    n_audio_head: int = 6
    n_audio_layer: int = 4
    n_vocab: int = 51864
    n_text_ctx: int = 448
    n_text_state: int = 384
    n_text_head: int = 6
    n_text_layer: int = 4

    @classmethod
    def from_dict(cls, params: dict) -> ModelArgs:
        return cls(**{k: v for k, v in params.items() if k in cls.__dataclass_fields__})


# --- log-mel front end (numpy; it is a few ms even for 30 s) ---


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    # Slaney scale: linear below 1 kHz, logarithmic above.
    f_sp = 200.0 / 3
    min_log_hz, logstep = 1000.0, np.log(6.4) / 27.0
    lin = f / f_sp
    log = min_log_hz / f_sp + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep
    return np.where(f >= min_log_hz, log, lin)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    f_sp = 200.0 / 3
    min_log_hz, logstep = 1000.0, np.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@lru_cache(maxsize=4)
def mel_filters(n_mels: int, n_fft: int = N_FFT, sr: int = SAMPLE_RATE) -> np.ndarray:
    """Slaney-normalised triangular mel filter bank, shape (n_mels, n_fft // 2 + 1)."""
    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_pts = np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(sr / 2)), n_mels + 2)
    hz_pts = _mel_to_hz(mel_pts)
    fdiff = np.diff(hz_pts)
    ramps = hz_pts[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (hz_pts[2:] - hz_pts[:-2]))[:, None]
    return weights.astype(np.float32)


@lru_cache(maxsize=1)
def _hann(n: int) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)


def log_mel_spectrogram(
    audio: np.ndarray, n_mels: int = 80, n_frames: int | None = None
) -> np.ndarray:
    """Whisper's log-mel features of 16 kHz audio, shape (frames, n_mels).

    Whisper follows the audio with a full window of silence; the features here are those
    of that padded signal, of which only the first `n_frames` rows (default: all) are
    computed. Silence never raises the maximum the log range is clamped against, so a
    row's value does not depend on how many rows are computed.
    """
    audio = np.asarray(audio, np.float32)
    total = (len(audio) + N_SAMPLES) // HOP_LENGTH
    n_frames = total if n_frames is None else min(n_frames, total)
    # Enough zeros that every computed frame, reflection padding included, sees silence
    # where Whisper's padded signal has it.
    n_zeros = max(0, n_frames * HOP_LENGTH - len(audio)) + N_FFT
    x = np.concatenate([audio, np.zeros(n_zeros, np.float32)])
    x = np.pad(x, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.as_strided(
        x, shape=(n_frames, N_FFT), strides=(x.strides[0] * HOP_LENGTH, x.strides[0])
    )
    power = np.abs(np.fft.rfft(frames * _hann(N_FFT), axis=-1)) ** 2
    # Not `@`: numpy's BLAS threads would spin on both cores for a while after this
    # small product, halving the speed of the MLX encoder that runs next. einsum's own
    # loop takes under a millisecond for a short utterance.
    mel = np.einsum("tk,mk->tm", power, mel_filters(n_mels))
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


# --- model ---


def _sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int, attend: Attend = _sdpa):
        super().__init__()
        self.n_head = n_head
        self.attend = attend
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def split_heads(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, self.n_head, -1).transpose(0, 2, 1, 3)

    def __call__(
        self,
        x: mx.array,
        kv: tuple[mx.array, mx.array],
        mask: str | mx.array | None = None,
    ) -> mx.array:
        # Keys/values come in already projected: cached (cross) or freshly grown (self).
        B, L, D = x.shape
        q = self.split_heads(self.query(x))
        k, v = kv
        scale = (D // self.n_head) ** -0.5
        o = self.attend(q, k, v, scale, mask)
        return self.out(o.transpose(0, 2, 1, 3).reshape(B, L, D))

    def project_kv(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.split_heads(self.key(x)), self.split_heads(self.value(x))

    def native(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Unmasked attention of one item's projected rows (time, n_state), one head at a
        time, before the output projection."""
        width = q.shape[1] // self.n_head
        scale = width**-0.5
        out = np.empty_like(q)
        for h in range(self.n_head):
            cols = slice(h * width, (h + 1) * width)
            p = kernels.softmax(kernels.matmul(q[:, cols] * scale, k[:, cols].T))
            out[:, cols] = kernels.matmul(p, v[:, cols])
        return out


class _Block(nn.Module):
    """Self-attention and an MLP, each around a residual: what every layer has.

    The decoder's layers take MLX's own GELU and attention: a step's few rows make every
    op's dispatch cost more than its arithmetic. The encoder's hundreds of rows take
    `fast_ops`' (MLX's CPU runs `erf` and `exp` one element at a time)."""

    gelu: Callable[[mx.array], mx.array] = staticmethod(nn.gelu)
    attend: Attend = staticmethod(_sdpa)

    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head, self.attend)
        self.attn_ln = nn.LayerNorm(n_state)
        self.mlp1 = nn.Linear(n_state, 4 * n_state)
        self.mlp2 = nn.Linear(4 * n_state, n_state)
        self.mlp_ln = nn.LayerNorm(n_state)

    def self_attention(
        self, x: mx.array, cache: list | None, mask: str | mx.array | None
    ) -> mx.array:
        h = self.attn_ln(x)
        k, v = self.attn.project_kv(h)
        if cache is not None:
            # cache holds this layer's self-attention [keys, values], grown in place.
            if cache[0] is not None:
                k = mx.concatenate([cache[0], k], axis=2)
                v = mx.concatenate([cache[1], v], axis=2)
            cache[0], cache[1] = k, v
        return x + self.attn(h, (k, v), mask=mask)

    def mlp(self, x: mx.array) -> mx.array:
        return x + self.mlp2(self.gelu(self.mlp1(self.mlp_ln(x))))


class EncoderBlock(_Block):
    """An encoder layer."""

    gelu = staticmethod(fast_ops.gelu)
    attend = staticmethod(fast_ops.attention)

    def __call__(self, x: mx.array) -> mx.array:
        return self.mlp(self.self_attention(x, None, None))

    def native(self, x: np.ndarray) -> np.ndarray:
        """The layer over one item's rows x (time, n_state), unmasked, through the native
        kernels; the query, key and value projections in one product."""
        attn = self.attn
        h = _layer_norm(self.attn_ln, x)
        q, k, v = np.split(_linear(h, attn.query, attn.key, attn.value), 3, axis=1)
        x = _linear(attn.native(q, k, v), attn.out, residual=x)
        h = kernels.gelu(_linear(_layer_norm(self.mlp_ln, x), self.mlp1))
        return _linear(h, self.mlp2, residual=x)


class DecoderBlock(_Block):
    """A decoder layer: between the two, cross-attention to the audio."""

    def __init__(self, n_state: int, n_head: int):
        super().__init__(n_state, n_head)
        self.cross_attn = MultiHeadAttention(n_state, n_head, self.attend)
        self.cross_attn_ln = nn.LayerNorm(n_state)

    def __call__(
        self,
        x: mx.array,
        cross_kv: tuple[mx.array, mx.array],
        cache: list | None = None,
        mask: str | mx.array | None = None,
    ) -> mx.array:
        x = self.self_attention(x, cache, mask)
        x = x + self.cross_attn(self.cross_attn_ln(x), cross_kv)
        return self.mlp(x)


class AudioEncoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        n = args.n_audio_state
        self.conv1 = nn.Conv1d(args.n_mels, n, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(n, n, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = mx.zeros((args.n_audio_ctx, n))
        self.blocks = [EncoderBlock(n, args.n_audio_head) for _ in range(args.n_audio_layer)]
        self.ln_post = nn.LayerNorm(n)
        # On the CPU, item by item through `engine.native.kernels` (`load_model`).
        self.native = False

    def __call__(self, mel: mx.array) -> mx.array:
        """mel: (B, frames, n_mels), any frame count up to the full window's 3000."""
        if self.native and mx.default_device() == mx.cpu:
            return mx.array(np.stack([self._native(m) for m in np.array(mel)]))
        x = fast_ops.gelu(self.conv1(mel))
        x = fast_ops.gelu(self.conv2(x))
        x = x + self.positional_embedding[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)

    def _native(self, mel: np.ndarray) -> np.ndarray:
        conv1, conv2 = self._native_convs()
        x = kernels.gelu(kernels.conv1d(mel, conv1[0], length=len(mel), pad_left=1, bias=conv1[1]))
        x = kernels.gelu(kernels.strided_conv1d(x, *conv2))
        x += np.array(self.positional_embedding[: len(x)])
        for block in self.blocks:
            x = block.native(x)
        return _layer_norm(self.ln_post, x)

    def _native_convs(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        # Packed for the kernel once per pair of weight arrays.
        cached = getattr(self, "_packed", None)
        if cached is not None and cached[0] is self.conv1.weight and cached[1] is self.conv2.weight:
            return cached[2]  # type: ignore[no-any-return]
        convs = tuple(
            (taps, kernels.padded_bias(np.array(conv.bias), taps))
            for taps, conv in (
                (kernels.pack_taps(np.array(self.conv1.weight)), self.conv1),
                (kernels.pack_strided_taps(np.array(self.conv2.weight)), self.conv2),
            )
        )
        object.__setattr__(self, "_packed", (self.conv1.weight, self.conv2.weight, convs))
        return convs


class TextDecoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        n = args.n_text_state
        self.token_embedding = nn.Embedding(args.n_vocab, n)
        self.positional_embedding = mx.zeros((args.n_text_ctx, n))
        self.blocks = [DecoderBlock(n, args.n_text_head) for _ in range(args.n_text_layer)]
        self.ln = nn.LayerNorm(n)

    def cross_kv(self, audio_features: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Per-layer cross-attention keys/values: computed once per utterance."""
        return [b.cross_attn.project_kv(audio_features) for b in self.blocks]

    def make_cache(self) -> list[list]:
        return [[None, None] for _ in self.blocks]

    def hidden(
        self,
        tokens: mx.array,
        cross_kv: list[tuple[mx.array, mx.array]],
        cache: list[list],
        pads: mx.array | None = None,
    ) -> mx.array:
        """Final hidden states (B, L, n_state): the logits are these times the embedding.

        `pads` (B,) says how many left-padding tokens each row's sequence starts with, so
        rows with prompts of different lengths share one pass: a row's tokens keep the
        positions they would have alone, and no token attends to its row's padding.
        """
        offset = cache[0][0].shape[2] if cache[0][0] is not None else 0
        L = tokens.shape[1]
        x = self.token_embedding(tokens)
        if pads is None:
            x = x + self.positional_embedding[offset : offset + L]
            mask: str | mx.array | None = "causal" if L > 1 else None
        else:
            x = x + self.positional_embedding[_row_positions(offset, L, pads)]
            mask = _padded_causal_mask(offset, L, pads)
        for block, kv, c in zip(self.blocks, cross_kv, cache, strict=True):
            x = block(x, kv, c, mask)
        return self.ln(x)

    def __call__(
        self, tokens: mx.array, cross_kv: list[tuple[mx.array, mx.array]], cache: list[list]
    ) -> mx.array:
        return self.token_embedding.as_linear(self.hidden(tokens, cross_kv, cache))


def _layer_norm(norm: nn.LayerNorm, x: np.ndarray) -> np.ndarray:
    return kernels.layer_norm(x, np.array(norm.weight), np.array(norm.bias), eps=norm.eps)


def _linear(x: np.ndarray, *layers: nn.Linear, residual: np.ndarray | None = None) -> np.ndarray:
    """x @ the layers' weights side by side (+ their biases, + residual) through the native
    kernel, the weights packed once per set of weight arrays (a cache on the first layer)."""
    weights = [layer.weight for layer in layers]
    cached = getattr(layers[0], "_packed", None)
    if (
        cached is None
        or len(cached[0]) != len(weights)
        or any(a is not b for a, b in zip(cached[0], weights, strict=False))
    ):
        taps = kernels.pack_taps(np.concatenate([np.array(w) for w in weights])[:, None, :])
        biases = [
            np.array(layer.bias) if "bias" in layer else np.zeros(len(layer.weight), np.float32)
            for layer in layers
        ]
        cached = (weights, taps, kernels.padded_bias(np.concatenate(biases), taps))
        object.__setattr__(layers[0], "_packed", cached)
    _, taps, bias = cached
    y = kernels.conv1d(x, taps, length=len(x), pad_left=0, bias=bias, residual=residual)
    width = sum(len(w) for w in weights)
    return y if y.shape[1] == width else y[:, :width]


def _row_positions(offset: int, length: int, pads: mx.array) -> mx.array:
    # A padding slot takes position 0: its state is never attended to by a real token.
    return mx.maximum(mx.arange(offset, offset + length)[None] - pads[:, None], 0)


def _padded_causal_mask(offset: int, length: int, pads: mx.array) -> mx.array:
    """Boolean (B, 1, L, S) mask: causal, and blind to each row's left padding.

    Each slot also sees itself, so that padding slots (which see nothing else) stay finite:
    a NaN there would leak through the zero weights of the real tokens' attention.
    """
    queries = mx.arange(offset, offset + length)[None, :, None]
    keys = mx.arange(offset + length)[None, None, :]
    seen = (keys <= queries) & (keys >= pads[:, None, None])
    seen = seen | (keys == queries)
    return seen[:, None]


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.encoder = AudioEncoder(args)
        self.decoder = TextDecoder(args)


def load_model(model_dir: Path, dtype: mx.Dtype = mx.float32) -> tuple[Model, dict]:
    """Load a converted Whisper directory; returns the model and its config dict."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model = Model(ModelArgs.from_dict(config))
    weights = mx.load(str(Path(model_dir) / "model.safetensors"))
    if not isinstance(weights, dict):
        raise ValueError(f"{model_dir}: model.safetensors holds no named weights")
    model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    model.encoder.native = dtype == mx.float32 and kernels.load()
    return model, config
