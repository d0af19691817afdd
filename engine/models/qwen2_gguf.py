"""Convert a Qwen2 GGUF (Qwen2.5-Coder instruct, Q4_K_M) into an mlx-lm model directory
that the engine's llama class runs.

The carriers split the GGUF into raw chunks (`data/partNN.bin`, one package each); they
are joined into one temporary file first. MLX's own GGUF reader cannot read the block
types a Q4_K_M file mixes (Q4_K, Q6_K, Q5_0, Q8_0), so llama.cpp's `gguf` package reads
the file and dequantizes every block.

Qwen2 is llama with biases on the query, key and value projections: the output names
`model_type: llama` with `attention_bias`, and gives the output projection a zero bias.
Unlike llama GGUFs, qwen2 ones keep the rotary rows in Hugging Face's order, so nothing
is permuted back.

With `precision="fp32"` (the CPU's) the engine's few-row products read each matrix from a
compact twin (`engine.native.gemv_forward`). A Q4_K matrix keeps its values exactly:
its blocks' own 4-bit groups (each value q * scale + offset) are written beside the
weights (`gemv_forward.GROUPS_FILE`), and its twin is made from them at load. Every
other quantized matrix, and a Q4_K one that the llama class joins into one product with
another type (query, key and value, or gate and up: `engine.models.llama.JOINED`), is
rounded again per group of 32 to signed 8-bit integers times the group's largest
magnitude / 127, the form the twins find in fp32 weights by themselves; 8 bits keep
every block type (at most 6 bits of resolution per block) to within half an 8-bit step.
`precision="4bit"` stores MLX's own affine groups for its quantized kernels (Metal,
CUDA): Q4_K (already 4-bit groups of 32) in 4 bits, the 5-, 6- and 8-bit types in 8.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import Regex, normalizers, pre_tokenizers

from engine.models.smollm2_gguf import write_tokenizer
from engine.native import gemv_forward

__all__ = [
    "CONVERTER_VERSION",
    "convert",
    "dequantize",
    "q4_k_groups",
    "requantize_bits",
    "symmetric_8bit",
]

CONVERTER_VERSION = "3"
GROUP_SIZE = 32
# Qwen2's pre-tokenizer split (its tokenizer.json), before the byte-level step.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
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
    from gguf import GGUFReader

    with _joined(Path(source_dir), Path(out_dir)) as path:
        reader = GGUFReader(path)
        meta = _metadata(reader)
        config = _config(meta)
        tensors = list(reader.tensors)
        steps = len(tensors) + 1
        config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in tensors)
        weights: dict[str, mx.array] = {}
        twins: dict[str, mx.array] = {}
        quantized: dict[str, Any] = {}
        exact = _exact_4bit(tensors) if precision == "fp32" else set()
        for i, tensor in enumerate(tensors):
            module, kind = _mlx_name(tensor.name)
            raw = np.asarray(tensor.data)
            values = dequantize(raw, int(tensor.tensor_type))
            bits = requantize_bits(int(tensor.tensor_type))
            if bits is None or values.ndim != 2:
                weights[f"{module}.{kind}"] = mx.array(values.astype(np.float32))
            elif module in exact:
                weights[f"{module}.{kind}"] = mx.array(values)
                q, scales, offsets = q4_k_groups(raw)
                twins |= {
                    f"{module}.twin_q": mx.array(q),
                    f"{module}.twin_scales": mx.array(scales),
                }
                twins[f"{module}.twin_offsets"] = mx.array(offsets)
            else:
                weights |= _grouped(module, values, bits, precision)
                if precision == "4bit":
                    quantized[module] = {"group_size": GROUP_SIZE, "bits": bits}
            progress(i + 1, steps)
        del reader, tensors
        hidden = config["hidden_size"]
        for layer in range(config["num_hidden_layers"]):
            # The llama class has one bias switch for all four projections.
            weights[f"model.layers.{layer}.self_attn.o_proj.bias"] = mx.zeros((hidden,))
        if quantized:
            widths = Counter(q["bits"] for q in quantized.values())
            common = widths.most_common(1)[0][0]
            config["quantization"] = {"group_size": GROUP_SIZE, "bits": common, **quantized}
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        if twins:
            mx.save_safetensors(str(out_dir / gemv_forward.GROUPS_FILE), twins)
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        write_tokenizer(
            meta,
            out_dir,
            pre_tokenizer=pre_tokenizers.Sequence([split, byte_level]),
            normalizer=normalizers.NFC(),  # as Qwen2's own tokenizer
            # Qwen's chat template starts every prompt itself; no BOS before it.
            add_bos_token=False,
        )
        progress(steps, steps)


def dequantize(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """The float32 values of a GGUF tensor's raw blocks (llama.cpp's `gguf` reader)."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(blocks, GGMLQuantizationType(qtype)).astype(np.float32)


def requantize_bits(qtype: int) -> int | None:
    """The MLX group width a GGUF block type is quantized again into; None for floats."""
    from gguf import GGMLQuantizationType as T

    kind = T(qtype)
    if kind in (T.F32, T.F16, T.BF16):
        return None
    return 4 if kind in (T.Q4_K, T.Q4_0, T.Q4_1) else 8


def q4_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K matrix's raw blocks (a row of 144-byte blocks per matrix row) as groups of
    32 in a twin's layout: q packed two to a byte (byte j of a group holds values j and
    j + 16), and each group's scale and offset, such that every value is q * scale +
    offset exactly as `dequantize` computes it."""
    from gguf.quants import Q4_K

    rows = blocks.shape[0]
    b = blocks.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    scales = d * sc.astype(np.float32)  # (blocks, 8): eight groups of 32 per block
    offsets = -(dmin * m.astype(np.float32))
    shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = ((b[:, 16:].reshape(-1, 4, 1, 32) >> shifts) & np.uint8(15)).reshape(-1, 32)
    packed = q[:, :16] | (q[:, 16:] << np.uint8(4))
    return packed.reshape(rows, -1), scales.reshape(rows, -1), offsets.reshape(rows, -1)


def _exact_4bit(tensors: list[Any]) -> set[str]:
    """The modules whose Q4_K values stay exact: Q4_K matrices that the llama class joins
    into one product only with other Q4_K matrices."""
    from gguf import GGMLQuantizationType as T

    from engine.models.llama import JOINED

    kinds = {
        _mlx_name(t.name)[0]: T(int(t.tensor_type)) for t in tensors if t.name.endswith(".weight")
    }
    exact = {module for module, kind in kinds.items() if kind == T.Q4_K}
    for module in list(exact):
        prefix, _, name = module.rpartition(".")
        for _, parts, _ in JOINED:
            if name in parts and any(kinds.get(f"{prefix}.{part}") != T.Q4_K for part in parts):
                exact.discard(module)
    return exact


def _grouped(module: str, values: np.ndarray, bits: int, precision: str) -> dict[str, mx.array]:
    if precision == "fp32":
        return {f"{module}.weight": mx.array(symmetric_8bit(values))}
    q, scales, biases = mx.quantize(mx.array(values), group_size=GROUP_SIZE, bits=bits)
    return {f"{module}.weight": q, f"{module}.scales": scales, f"{module}.biases": biases}


def symmetric_8bit(values: np.ndarray) -> np.ndarray:
    """`values` (rows of a multiple of 32) rounded, per group of 32, to q * s with q an
    integer in -127..127 and s the group's largest magnitude / 127, in float32 exactly
    as `engine.native.gemv_forward` checks it: s is computed again from the rounded group, so
    the rounding repeats until it no longer changes the group (twice, nearly always)."""
    groups = values.astype(np.float32).reshape(-1, GROUP_SIZE)
    for _ in range(8):
        scale = np.abs(groups).max(axis=1, keepdims=True) / np.float32(127)
        safe = np.where(scale == 0, np.float32(1), scale)
        rounded = (np.rint(groups / safe) * scale).astype(np.float32)
        if np.array_equal(rounded, groups):
            break
        groups = rounded
    return groups.reshape(values.shape)


@contextmanager
def _joined(source_dir: Path, out_dir: Path) -> Iterator[Path]:
    """The GGUF: a single `.gguf` file, or the carriers' numbered chunks joined into a
    temporary file that goes when the conversion ends."""
    whole = sorted(source_dir.rglob("*.gguf"))
    if len(whole) == 1:
        yield _checked(whole[0])
        return
    parts = sorted(source_dir.rglob("part*.bin"), key=_part_number)
    numbers = [_part_number(p) for p in parts]
    if whole or not parts or numbers != list(range(1, len(parts) + 1)):
        raise FileNotFoundError(
            f"expected one .gguf file or chunks part01.bin, part02.bin, ... under "
            f"{source_dir}; found {len(whole)} .gguf files and chunks {numbers}"
        )
    path = out_dir / ".joined.gguf"
    try:
        with open(path, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 24)
        yield _checked(path)
    finally:
        path.unlink(missing_ok=True)


def _part_number(path: Path) -> int:
    match = re.search(r"(\d+)\.bin$", path.name)
    return int(match[1]) if match else -1


def _checked(path: Path) -> Path:
    with open(path, "rb") as fh:
        head = fh.read(8)
    version = int.from_bytes(head[4:8], "little") if len(head) == 8 else -1
    if head[:4] != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path.name} is not a GGUF v2/v3 file (damaged download?)")
    return path


def _metadata(reader: Any) -> dict[str, Any]:
    """The GGUF's key/value fields: scalars, strings and lists as Python values, the
    token types as an array (what `write_tokenizer` reads)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    meta["tokenizer.ggml.token_type"] = np.asarray(meta["tokenizer.ggml.token_type"])
    return meta


def _config(meta: dict[str, Any]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "qwen2":
        raise ValueError(f"expected a qwen2 GGUF model, this one is {arch!r}")

    def get(key: str) -> Any:
        return meta[f"qwen2.{key}"]

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base")),
        "rope_traditional": False,
        "attention_bias": True,
        "mlp_bias": False,
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "torch_dtype": "float32",
    }


def _mlx_name(gguf_name: str) -> tuple[str, str]:
    """`blk.3.attn_q.bias` -> (`model.layers.3.self_attn.q_proj`, `bias`)."""
    base, _, kind = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}", kind
    return TOP_NAMES[base], kind
