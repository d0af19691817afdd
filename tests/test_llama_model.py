"""The engine's llama model file: its math against MLX's and float64, and the real
SmolLM2 through it against mlx-lm's own llama class."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama as mlx_lm_llama
from mlx_lm.models.base import create_causal_mask

from engine.models import llama
from engine.weights import registry

HEADS, KV_HEADS, DIM = 9, 3, 64
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
}


def qkv(batch: int, length: int, keys: int) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(7)
    q = mx.random.normal((batch, HEADS, length, DIM))
    k = mx.random.normal((batch, KV_HEADS, keys, DIM))
    v = mx.random.normal((batch, KV_HEADS, keys, DIM))
    return q, k, v


def reference(q: mx.array, k: mx.array, v: mx.array, mask: Any) -> np.ndarray:
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5, mask=mask)
    return np.array(out)


@pytest.mark.parametrize(
    ("batch", "length", "keys", "mask"),
    [
        (3, 1, 17, None),  # decode
        (2, 6, 6, "causal"),  # a fresh prompt
        (2, 4, 11, "causal"),  # a chunk after cached tokens
    ],
)
def test_attention_matches_mlx(batch: int, length: int, keys: int, mask: Any) -> None:
    q, k, v = qkv(batch, length, keys)
    got = np.array(llama.attention(q, k, v, DIM**-0.5, mask))
    np.testing.assert_allclose(got, reference(q, k, v, mask), atol=2e-5, rtol=1e-4)


def test_attention_with_a_left_padding_mask_matches_mlx() -> None:
    # The batched cache's mask: (B, 1, L, S), rows padded on the left by different amounts.
    q, k, v = qkv(3, 1, 9)
    mask = create_causal_mask(1, offset=8, left_padding=mx.array([0, 3, 5]))
    got = np.array(llama.attention(q, k, v, DIM**-0.5, mask))
    np.testing.assert_allclose(got, reference(q, k, v, mask), atol=2e-5, rtol=1e-4)


def test_attention_with_a_per_head_mask_matches_mlx() -> None:
    q, k, v = qkv(2, 3, 7)
    rng = np.random.default_rng(3)
    allowed = rng.random((2, HEADS, 3, 7)) < 0.6
    allowed[..., 0] = True  # every row keeps a key
    mask = mx.array(allowed)
    got = np.array(llama.attention(q, k, v, DIM**-0.5, mask))
    np.testing.assert_allclose(got, reference(q, k, v, mask), atol=2e-5, rtol=1e-4)


def test_a_fully_masked_padding_row_stays_finite() -> None:
    q, k, v = qkv(2, 4, 4)
    mask = create_causal_mask(4, left_padding=mx.array([0, 2]))  # row 1's first queries see nothing
    out = np.array(llama.attention(q, k, v, DIM**-0.5, mask))
    assert np.isfinite(out).all()


@pytest.mark.parametrize("offset", [0, 37, mx.array([5, 0, 120])])
def test_shared_rotary_angles_match_mlx_rope(offset: Any) -> None:
    x = mx.random.normal((3, HEADS, 4, DIM))
    got = llama.rotate(x, *llama.rotary_angles(offset, 4, DIM, 100000.0))
    want = mx.fast.rope(x, DIM, traditional=False, base=100000.0, scale=1.0, offset=offset)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


def test_exp_silu_and_softmax_are_as_accurate_as_float64_allows() -> None:
    x64 = np.linspace(-30.0, 30.0, 100_001)
    x = mx.array(x64.astype(np.float32))
    xr = np.array(x).astype(np.float64)  # the float32 inputs, exactly
    np.testing.assert_allclose(np.array(llama.exp(x)), np.exp(xr), rtol=2e-6)
    np.testing.assert_allclose(
        np.array(llama.silu(x)), xr / (1 + np.exp(-xr)), rtol=2e-6, atol=1e-7
    )
    rows = xr[:1000].reshape(10, 100) / 3
    want = np.exp(rows - rows.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    got = np.array(llama.softmax(mx.array(rows.astype(np.float32))))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 64), (2, 960)])
def test_the_compiled_norm_and_swiglu_match_mlx(shape: tuple[int, ...]) -> None:
    # Compiled shapeless: any batch, length and width, with MLX's own results.
    x = mx.random.normal(shape, key=mx.random.key(1))
    weight = mx.random.normal(shape[-1:], key=mx.random.key(2))
    got, want = llama.rms_norm(x, weight, 1e-5), mx.fast.rms_norm(x, weight, 1e-5)
    assert np.allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)
    norm = llama.RMSNorm(shape[-1], eps=1e-5)
    assert np.allclose(
        np.array(norm(x)), np.array(mx.fast.rms_norm(x, norm.weight, 1e-5)), atol=1e-6
    )
    up = mx.random.normal(shape, key=mx.random.key(3))
    assert np.array_equal(np.array(llama.swiglu(x, up)), np.array(llama.silu(x) * up))


def test_plain_llama_configs_are_supported_and_others_not() -> None:
    assert llama.is_supported({"model_type": "llama"})
    assert not llama.is_supported({"model_type": "qwen2"})
    sliding = {"model_type": "llama", "layer_types": ["sliding_attention", "full_attention"]}
    assert not llama.is_supported(sliding)
    scaled = {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert not llama.is_supported(scaled)
    assert not llama.is_supported({"model_type": "llama", "rope_traditional": True})


@pytest.mark.models
def test_an_unsupported_config_loads_with_mlx_lms_class(tmp_path: Path) -> None:
    # A one-layer model saved with mlx-lm's llama class and marked as scaled RoPE.
    config = TINY | {"rope_scaling": {"type": "linear", "factor": 2.0}}
    saved = mlx_lm_llama.Model(mlx_lm_llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(saved.parameters()))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = registry.prepare("smollm2-135m-instruct", progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, tmp_path / name)
    model, _ = llama.load(tmp_path)
    assert type(model) is mlx_lm_llama.Model


@pytest.fixture(scope="module")
def both() -> tuple[Any, Any, Any]:
    path = registry.prepare("smollm2-135m-instruct", progress=False)
    ours, tokenizer = llama.load(path)
    theirs, _ = mlx_lm.load(str(path))
    return ours, theirs, tokenizer


@pytest.mark.models
def test_smollm2_logits_match_mlx_lms_llama(both: tuple[Any, Any, Any]) -> None:
    ours, theirs, tokenizer = both
    assert type(ours) is llama.Model
    tokens = mx.array([tokenizer.encode("The lighthouse keeper climbed the stairs at dusk and")])
    got, want = np.array(ours(tokens)), np.array(theirs(tokens))
    assert np.abs(got - want).max() < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.models
@pytest.mark.parametrize(
    "question", ["What is the capital of France?", "Write one sentence about cats."]
)
def test_smollm2_greedy_text_matches_mlx_lms_llama(
    both: tuple[Any, Any, Any], question: str
) -> None:
    ours, theirs, tokenizer = both
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    texts = [mlx_lm.generate(m, tokenizer, prompt, max_tokens=24) for m in (ours, theirs)]
    assert texts[0] == texts[1]
    assert texts[0].strip()


def test_softmax_of_a_single_score_is_one() -> None:
    # MLX 0.32's shapeless compile crashes on this shape (attention's first key).
    scores = mx.array([[[[3.0]], [[-2.0]], [[0.5]]]])
    assert np.array(llama.softmax(scores)).tolist() == [[[[1.0]], [[1.0]], [[1.0]]]]
