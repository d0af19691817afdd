"""Llama decoder for the LLM stage: the module tree, weights and cache interface of
mlx-lm's llama, with a forward pass shaped for batched decode on MLX's CPU backend.

What differs from mlx-lm, measured by `bench/elementwise.py` and
`bench/llm_batch.py`:
  - MLX's CPU `exp` (and `sigmoid`, `softmax`, which use it) costs about 12 ns per
    element, while `power` with a constant base runs 2-3x faster at the same accuracy
    (relative error under 1e-6 against float64, as `exp`'s own). SiLU and the attention
    softmax go through `exp` below; they are most of a batched step's elementwise work.
  - Attention multiplies each key/value head by its whole group of query heads at once
    (one product of `group x length` rows instead of one per query head), so a decode
    step of B sequences makes B x kv_heads small products, not B x heads.
  - At one stream a decode step is mostly per-op overhead, so it makes fewer ops: it
    runs on (B, D) rows, so that its products need no reshaping to 2-D and back; the
    rotary angles are computed once per forward and shared by every layer; queries and
    keys rotate together, as `x * cos + roll(x) * sin` (mlx-lm's non-traditional rope
    in half the ops of slicing the halves apart); and the query, key and value
    projections are one product, as are the gate and up projections, with weights
    joined at load (`Model.sanitize`); and the elementwise chains of RMSNorm, SwiGLU
    and softmax are compiled (`mx.compile`, shapeless), so each runs as one fused
    kernel after its reduction (MLX's CPU `fast.rms_norm` runs its eight ops one by
    one). Without a C++ compiler MLX runs them unfused, with the same results.
Llama models with sliding-window layers, scaled or interleaved RoPE load with mlx-lm's
own class.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.llama import ModelArgs
from mlx_lm.utils import load_model, load_tokenizer

from engine.models import fast_ops
from engine.native import llama_step

__all__ = [
    "Model",
    "ModelArgs",
    "RMSNorm",
    "attention",
    "exp",
    "load",
    "is_supported",
    "join_projections",
    "rotary_angles",
    "rms_norm",
    "rotate",
    "silu",
    "softmax",
    "swiglu",
]

E = math.e


def exp(x: mx.array) -> mx.array:
    return mx.power(E, x)


def silu(x: mx.array) -> mx.array:
    return x / (1.0 + exp(-x))


def softmax(x: mx.array) -> mx.array:
    # MLX 0.32's shapeless compile crashes the process on the broadcast below when the
    # axis has length 1 (attention's first key, a one-token prompt); one score's
    # softmax is 1 anyway.
    return mx.ones_like(x) if x.shape[-1] == 1 else _softmax(x)


@partial(mx.compile, shapeless=True)
def _softmax(x: mx.array) -> mx.array:
    e = exp(x - mx.max(x, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return silu(gate) * up


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return _rms_norm(x, weight, eps, 1.0 / x.shape[-1])


# Shapeless, the mean's divisor would be an op of its own each call; a constant
# argument is part of the compiled function's key instead.
@partial(mx.compile, shapeless=True)
def _rms_norm(x: mx.array, weight: mx.array, eps: float, inverse_width: float) -> mx.array:
    mean_square = mx.sum(mx.square(x), axis=-1, keepdims=True) * inverse_width
    return weight * (x * mx.rsqrt(mean_square + eps))


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
    """`fast_ops.attention` with this file's softmax: one fused kernel after the max,
    fewer ops for a decode step's small score rows than `fast_ops.softmax`'s stages."""
    return fast_ops.attention(q, k, v, scale, mask, softmax=softmax)


def rotary_angles(
    offset: int | mx.array, length: int, head_dim: int, base: float
) -> tuple[mx.array, mx.array]:
    """The RoPE factors of `length` positions from `offset`, as `rotate` takes them: cos
    and sin of each angle, (length, D), or (B, 1, length, D) for a batch whose rows start
    at the offsets in a (B,) array; the first half of sin is negated."""
    inverse = base ** (-mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    if isinstance(offset, mx.array):
        positions = (offset[:, None] + mx.arange(length))[:, None, :, None]
    else:
        positions = mx.arange(offset, offset + length)[:, None]
    angles = positions.astype(mx.float32) * inverse
    cos, sin = mx.cos(angles), mx.sin(angles)
    return mx.concatenate([cos, cos], axis=-1), mx.concatenate([-sin, sin], axis=-1)


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """RoPE with the two halves of each head as the pairs (mlx-lm's non-traditional):
    (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin), each rounded as written so."""
    return x * cos + mx.roll(x, x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, bias = args.hidden_size, args.attention_bias
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads or self.n_heads  # None: no grouping
        self.head_dim = args.head_dim or dim // self.n_heads
        self.scale = self.head_dim**-0.5
        heads = self.n_heads + 2 * self.n_kv_heads
        self.qkv_proj = nn.Linear(dim, heads * self.head_dim, bias=bias)  # q, k, v rows
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)

    def __call__(
        self, x: mx.array, angles: tuple[mx.array, mx.array], mask: Any, cache: Any
    ) -> mx.array:
        """x is (B, L, D), or (B, D) for a decode step: one position per row, whose
        heads need no transposing to (B, heads, 1, head_dim) and back."""
        b = x.shape[0]
        qkv = self.qkv_proj(x)
        if x.ndim == 2:
            qkv = qkv.reshape(b, -1, 1, self.head_dim)
        else:
            qkv = qkv.reshape(b, x.shape[1], -1, self.head_dim).transpose(0, 2, 1, 3)
        rotated = self.n_heads + self.n_kv_heads
        qk = rotate(qkv[:, :rotated], *angles)
        q, k, v = qk[:, : self.n_heads], qk[:, self.n_heads :], qkv[:, rotated:]
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = attention(q, k, v, self.scale, mask)
        if x.ndim == 2:
            return self.o_proj(out.reshape(b, -1))
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, x.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias)  # gate rows, then up
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(swiglu(gate, up))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self, x: mx.array, angles: tuple[mx.array, mx.array], mask: Any, cache: Any
    ) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), angles, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        pause: Callable[[], None] | None = None,
    ) -> mx.array:
        """`pause`, if given, is called after each layer, once that layer is evaluated:
        a long prefill forward gives way there (`engine.runtime.urgency`)."""
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        offset = 0 if cache[0] is None else cache[0].offset
        batch, length = inputs.shape
        angles = rotary_angles(offset, length, self.head_dim, self.args.rope_theta)
        if length == 1:  # a decode step runs on (B, D) rows: 2-D products, no reshaping
            h = h.reshape(batch, -1)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, angles, mask, layer_cache)
            if pause is not None:
                mx.eval(h)
                pause()
        return self.norm(h).reshape(batch, length, -1)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def native_step(self) -> llama_step.LlamaStep | None:
        """This model's decode step as one native call (`engine.native.llama_step`), or
        None where that cannot run."""
        args, body = self.args, self.model
        attention, mlp = self.layers[0].self_attn, self.layers[0].mlp
        shape = llama_step.LlamaShape(
            layers=len(self.layers),
            dim=args.hidden_size,
            heads=attention.n_heads,
            kv_heads=attention.n_kv_heads,
            head_dim=attention.head_dim,
            hidden=mlp.down_proj.weight.shape[1],
            vocab=args.vocab_size,
            eps=args.rms_norm_eps,
        )
        weights: list[mx.array | None] = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            weights += [layer.input_layernorm.weight, *_weight_and_bias(a.qkv_proj)]
            weights += [*_weight_and_bias(a.o_proj), layer.post_attention_layernorm.weight]
            weights += [*_weight_and_bias(m.gate_up_proj), *_weight_and_bias(m.down_proj)]
        tied = args.tie_word_embeddings
        head = body.embed_tokens.weight if tied else self.lm_head.weight
        weights += [body.embed_tokens.weight, body.norm.weight, head]

        def angles(count: int) -> tuple[mx.array, mx.array]:
            return rotary_angles(0, count, attention.head_dim, args.rope_theta)

        return llama_step.load(shape, weights, angles)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return join_projections(weights)


def _weight_and_bias(linear: nn.Linear) -> tuple[mx.array, mx.array | None]:
    return linear.weight, linear.get("bias")


# Products that read the same input, each joined into one at load: (module, parts, joined).
JOINED = (
    ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
)


def join_projections(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Each layer's query, key and value projections as one qkv_proj, and its gate and up
    projections as one gate_up_proj, rows in that order: the same weights (and 4-bit
    scales and biases, which run along rows), fewer and larger products."""
    joined = dict(weights)
    for module, parts, name in JOINED:
        first = f".{module}.{parts[0]}."
        for weight in [n for n in weights if first in n]:
            prefix, kind = weight.split(first)
            names = [f"{prefix}.{module}.{part}.{kind}" for part in parts]
            joined[f"{prefix}.{module}.{name}.{kind}"] = mx.concatenate(
                [joined.pop(n) for n in names], axis=0
            )
    return joined


def is_supported(config: dict[str, Any]) -> bool:
    """Whether this file's class runs the model in `config` (a config.json's contents)."""
    sliding = "sliding_attention" in (config.get("layer_types") or ())
    plain_rope = not config.get("rope_scaling") and not config.get("rope_traditional")
    return config.get("model_type") == "llama" and not sliding and plain_rope


def load(path: str | Path) -> tuple[nn.Module, Any]:
    """Model and tokenizer from an mlx-lm model directory: this file's class where it
    `is_supported`, mlx-lm's own otherwise."""
    path = Path(path)
    if is_supported(json.loads((path / "config.json").read_text())):
        model, config = load_model(path, get_model_classes=lambda config: (Model, ModelArgs))
    else:
        model, config = load_model(path)
    return model, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
