"""Silero VAD v5 (16 kHz) on MLX: one 32 ms chunk per stream per call, batched over streams.

Input is `(B, context + chunk)` samples: the 64 samples that ended the stream's previous
chunk (zeros for the first one) followed by the new 512. The state is the LSTM's
`(2, B, hidden)` stack of h and c, the same layout as the ONNX model's `state` input.

Why an earlier MLX port differed from ONNX by up to 0.34 in single-chunk probability:
how the chunk is framed for the STFT, not the weights. Silero v5 reads the previous
chunk's last 64 samples in front of the new 512 and pads only the right edge, by
reflection: 640 samples, 4 STFT frames. Measured against onnxruntime on 10 s of
the alsa recordings (`bench/vad.py --ablation`, 312 chunks): symmetric reflection
padding (PyTorch's `ReflectionPad1d(64)`) moves probabilities by up to 0.32 and flips 4
decisions, the size of error reported; zero padding by 0.07; dropping the context by
0.999, flipping 183. The other candidates are exact: one summed `bias_ih + bias_hh` is
the ONNX LSTM's own arithmetic (rounding only), and the converter takes the branch that
`sr == 16000` selects (the 8 kHz weights do not fit these shapes). Fixed here: context
and right-only reflection, which matches onnxruntime to ~1e-6.

Rows run in blocks (`block`): every product is one BLAS call per block of rows, with the
weights broadcast over the blocks, so a row's result is bit for bit the same however many
blocks run with it (BLAS rounds a row by its place in a larger matrix), and the graph is
the same few dozen operations for one stream or a hundred. The STFT and the kernel-3
convolutions are written as products over gathered frames and taps for that reason: a
convolution folds every row into one product.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

__all__ = ["ModelArgs", "Model", "load"]


@dataclass
class ModelArgs:
    model_type: str = "silero"
    sample_rate: int = 16000
    chunk_size: int = 512
    context_size: int = 64
    filter_length: int = 256
    hop_length: int = 128
    hidden_size: int = 128
    encoder_channels: list[int] = field(default_factory=lambda: [128, 64, 64, 128])
    encoder_strides: list[int] = field(default_factory=lambda: [1, 2, 2, 1])

    @classmethod
    def from_dict(cls, params: dict) -> ModelArgs:
        known = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in known})


def _per_block(x: mx.array, weight: mx.array) -> mx.array:
    """`x` (blocks, rows, k) times `weight` (k, n): one product per block."""
    return x @ mx.broadcast_to(weight, (x.shape[0], *weight.shape))


class STFT(nn.Module):
    """Magnitude spectrum over frames of the exported (real; imaginary) DFT basis."""

    def __init__(self, filter_length: int, hop_length: int):
        super().__init__()
        self.filter_length = filter_length
        self.hop_length = hop_length
        self.pad = filter_length // 4
        self.weight = mx.zeros((filter_length + 2, filter_length, 1))  # a conv's layout

    def __call__(self, x: mx.array) -> mx.array:
        """(blocks, rows, samples) to (blocks, rows, frames, bins)."""
        # Silero pads the right edge only, by reflection (no repeat of the last sample).
        x = mx.concatenate([x, x[..., -self.pad - 1 : -1][..., ::-1]], axis=-1)
        blocks, rows, length = x.shape
        count = (length - self.filter_length) // self.hop_length + 1
        starts = range(0, count * self.hop_length, self.hop_length)
        frames = mx.stack([x[..., s : s + self.filter_length] for s in starts], axis=2)
        frames = frames.reshape(blocks, rows * count, self.filter_length)
        spec = _per_block(frames, self.weight[:, :, 0].T)
        re, im = mx.split(spec, 2, axis=-1)
        return mx.sqrt(re * re + im * im).reshape(blocks, rows, count, -1)


class Encoder(nn.Module):
    """One kernel-3 convolution (padding 1) and ReLU over each row's frames."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.weight = mx.zeros((out_channels, 3, in_channels))  # nn.Conv1d's layout
        self.bias = mx.zeros((out_channels,))

    def __call__(self, y: mx.array) -> mx.array:
        """(blocks, rows, frames, channels) to (blocks, rows, frames / stride, out)."""
        blocks, rows, frames, _ = y.shape
        out = (frames - 1) // self.stride + 1
        y = mx.pad(y, [(0, 0), (0, 0), (1, 1), (0, 0)])
        last = self.stride * (out - 1) + 1
        taps = mx.concatenate([y[:, :, k : k + last : self.stride] for k in range(3)], axis=-1)
        taps = taps.reshape(blocks, rows * out, -1)
        weight = self.weight.reshape(self.weight.shape[0], -1).T
        return nn.relu(_per_block(taps, weight) + self.bias).reshape(blocks, rows, out, -1)


class Decoder(nn.Module):
    """One LSTM-cell step, then ReLU, a 1x1 projection and a sigmoid."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight_ih = mx.zeros((4 * hidden_size, hidden_size))
        self.weight_hh = mx.zeros((4 * hidden_size, hidden_size))
        self.bias = mx.zeros((4 * hidden_size,))
        self.out = nn.Linear(hidden_size, 1)

    def __call__(self, x: mx.array, h: mx.array, c: mx.array) -> tuple[mx.array, ...]:
        """Each of (blocks, rows, hidden)."""
        gates = _per_block(x, self.weight_ih.T) + _per_block(h, self.weight_hh.T) + self.bias
        i, f, g, o = mx.split(gates, 4, axis=-1)  # PyTorch gate order
        c = mx.sigmoid(f) * c + mx.sigmoid(i) * mx.tanh(g)
        h = mx.sigmoid(o) * mx.tanh(c)
        out = _per_block(nn.relu(h), self.out.weight.T) + self.out.bias
        return mx.sigmoid(out)[..., 0], h, c


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.stft = STFT(args.filter_length, args.hop_length)
        widths = [args.filter_length // 2 + 1, *args.encoder_channels]
        self.encoder = [
            Encoder(widths[i], widths[i + 1], s) for i, s in enumerate(args.encoder_strides)
        ]
        self.decoder = Decoder(args.hidden_size)

    @property
    def input_size(self) -> int:
        return self.args.context_size + self.args.chunk_size

    def initial_state(self, batch: int) -> mx.array:
        return mx.zeros((2, batch, self.args.hidden_size))

    def __call__(
        self, x: mx.array, state: mx.array, block: int | None = None
    ) -> tuple[mx.array, mx.array]:
        """Probabilities (B,) and the next state for x (B, input_size) and state
        (2, B, hidden), the rows in blocks of `block` (None: one block of B)."""
        if x.ndim != 2 or x.shape[1] != self.input_size:
            raise ValueError(f"expected (batch, {self.input_size}) samples, got {x.shape}")
        batch = x.shape[0]
        block = block or batch
        if batch % block:
            raise ValueError(f"{batch} rows are not whole blocks of {block}")
        blocks = (batch // block, block)
        y = self.stft(x.reshape(*blocks, -1))
        for encoder in self.encoder:
            y = encoder(y)
        # 4 STFT frames shrink to exactly one frame through the two stride-2 convs.
        h, c = (s.reshape(*blocks, -1) for s in state)
        prob, h, c = self.decoder(y[:, :, 0, :], h, c)
        return prob.reshape(batch), mx.stack([h.reshape(batch, -1), c.reshape(batch, -1)])


def load(model_dir: Path) -> Model:
    model_dir = Path(model_dir)
    args = ModelArgs.from_dict(json.loads((model_dir / "config.json").read_text()))
    model = Model(args)
    model.load_weights(str(model_dir / "model.safetensors"), strict=True)
    mx.eval(model.parameters())
    return model
