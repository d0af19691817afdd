"""Convert a Piper voice (VITS exported to ONNX) into MLX safetensors + config.

Only the `onnx` package is used (no onnxruntime). The export hides a few weights:
the phoneme embedding is called `sid`; weight-normed flow convs are folded into unnamed
`onnx::Conv_N` tensors whose real names come from the Conv node that consumes them; and
the duration predictor's first affine flow keeps only `exp(-logs)` as a constant.
Hyper-parameters the weights do not carry (strides, dilations) are read from the nodes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["convert", "find_voice", "read_voice"]

_DEC_RESBLOCK = re.compile(r"^dec\.resblocks\.(\d+)\.convs(\d?)\.(\d+)$")


def find_voice(source_dir: Path) -> Path:
    """The single `*.onnx` voice in a package directory (searched recursively)."""
    found = sorted(
        p
        for p in Path(source_dir).rglob("*.onnx")
        if p.with_suffix(".onnx.json").is_file() or Path(str(p) + ".json").is_file()
    )
    if not found:
        raise FileNotFoundError(f"no Piper voice (*.onnx with *.onnx.json) under {source_dir}")
    return found[0]


def _node_weight_name(node_name: str) -> str:
    # "/flow/flows.0/enc/in_layers.0/Conv" -> "flow.flows.0.enc.in_layers.0"
    return ".".join(part for part in node_name.strip("/").split("/")[:-1])


def read_voice(onnx_path: Path) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """PyTorch-named float32 weights and, per conv/transposed conv, its node attributes."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    convs: dict[str, dict] = {}
    weights: dict[str, np.ndarray] = {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose"):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        prefix = _node_weight_name(node.name)
        attrs["op"] = node.op_type
        convs[prefix] = attrs
        weight_input = node.input[1]
        if weight_input.startswith("onnx::") and weight_input in inits:
            weights[f"{prefix}.weight"] = inits[weight_input]
    for name, value in inits.items():
        if name.startswith(("enc_p.", "dp.", "flow.", "dec.")):
            weights[name] = value
    if "sid" in inits:
        weights["enc_p.emb.weight"] = inits["sid"]
    elif "enc_p.emb.weight" not in weights:
        raise ValueError(f"{onnx_path}: no phoneme embedding (`sid` or `enc_p.emb.weight`)")
    if "dp.flows.0.logs" not in weights:
        folded = [v for k, v in inits.items() if k.startswith("/dp/flows.0/") and "Exp" in k]
        if len(folded) != 1:
            raise ValueError(f"{onnx_path}: cannot find the duration flow's folded exp(-logs)")
        weights["dp.flows.0.logs"] = -np.log(folded[0])
    if any(k.startswith("emb_g") for k in inits) or any(".cond." in k for k in weights):
        raise ValueError(f"{onnx_path}: multi-speaker Piper voices are not supported")
    return {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}, convs


def _count(weights: dict[str, np.ndarray], pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in weights if (m := rx.match(k))})


def model_config(weights: dict[str, np.ndarray], convs: dict[str, dict], voice: dict) -> dict:
    """`engine.models.vits.ModelArgs` fields, derived from shapes and node attributes."""
    hidden = weights["enc_p.emb.weight"].shape[1]
    rel_k = weights["enc_p.encoder.attn_layers.0.emb_rel_k"]
    n_resblocks = _count(weights, r"^dec\.resblocks\.(\d+)\.")
    n_ups = _count(weights, r"^dec\.ups\.(\d+)\.")
    n_kernels = n_resblocks // n_ups
    resblock = "1" if "dec.resblocks.0.convs1.0.weight" in weights else "2"
    kernels, dilations = [], []
    for j in range(n_kernels):
        layer = "convs1" if resblock == "1" else "convs"
        kernels.append(int(weights[f"dec.resblocks.{j}.{layer}.0.weight"].shape[2]))
        n = _count(weights, rf"^dec\.resblocks\.{j}\.{layer}\.(\d+)\.weight")
        dilations.append(
            [int(convs[f"dec.resblocks.{j}.{layer}.{i}"]["dilations"][0]) for i in range(n)]
        )
    flow_ids = sorted(
        {int(m.group(1)) for k in weights if (m := re.match(r"^flow\.flows\.(\d+)\.pre", k))}
    )
    dp_ids = sorted(
        {int(m.group(1)) for k in weights if (m := re.match(r"^dp\.flows\.(\d+)\.pre", k))}
    )
    dp_proj = weights[f"dp.flows.{dp_ids[0]}.proj.weight"]
    inference = voice.get("inference", {})
    return {
        "model_type": "vits",
        "num_symbols": int(weights["enc_p.emb.weight"].shape[0]),
        "hidden_channels": int(hidden),
        "inter_channels": int(weights["enc_p.proj.weight"].shape[0] // 2),
        "filter_channels": int(weights["enc_p.encoder.ffn_layers.0.conv_1.weight"].shape[0]),
        "n_heads": int(hidden // rel_k.shape[2]),
        "n_layers": _count(weights, r"^enc_p\.encoder\.attn_layers\.(\d+)\."),
        "kernel_size": int(weights["enc_p.encoder.ffn_layers.0.conv_1.weight"].shape[2]),
        "window_size": int((rel_k.shape[1] - 1) // 2),
        "dp_filter_channels": int(weights["dp.pre.weight"].shape[0]),
        "dp_kernel_size": int(weights["dp.convs.convs_sep.0.weight"].shape[2]),
        "dp_n_flows": len(dp_ids),
        "dp_num_bins": int((dp_proj.shape[0] + 1) // 3),
        "flow_n_flows": len(flow_ids),
        "flow_kernel_size": int(
            weights[f"flow.flows.{flow_ids[0]}.enc.in_layers.0.weight"].shape[2]
        ),
        "flow_n_layers": _count(weights, rf"^flow\.flows\.{flow_ids[0]}\.enc\.in_layers\.(\d+)\."),
        "resblock": resblock,
        "resblock_kernel_sizes": kernels,
        "resblock_dilation_sizes": dilations,
        "upsample_rates": [int(convs[f"dec.ups.{i}"]["strides"][0]) for i in range(n_ups)],
        "upsample_kernel_sizes": [
            int(weights[f"dec.ups.{i}.weight"].shape[2]) for i in range(n_ups)
        ],
        "upsample_initial_channel": int(weights["dec.conv_pre.weight"].shape[0]),
        "sample_rate": int(voice["audio"]["sample_rate"]),
        "noise_scale": float(inference.get("noise_scale", 0.667)),
        "length_scale": float(inference.get("length_scale", 1.0)),
        "noise_w": float(inference.get("noise_w", 0.8)),
    }


def to_mlx_layout(weights: dict[str, np.ndarray], convs: dict[str, dict]) -> dict[str, np.ndarray]:
    """PyTorch conv (O,I,K) and transposed conv (I,O,K) to MLX's (O,K,I)."""
    out = {}
    for name, w in weights.items():
        prefix = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and w.ndim == 3:
            if convs.get(prefix, {}).get("op") == "ConvTranspose":
                w = w.transpose(1, 2, 0)
            else:
                w = w.transpose(0, 2, 1)
        out[name] = np.ascontiguousarray(w)
    return out


def convert(source_dir: Path, out_dir: Path, progress: Callable[[int, int], None]) -> None:
    """Write `model.safetensors`, `config.json` and the voice's `voice.json` to out_dir."""
    import mlx.core as mx

    onnx_path = find_voice(Path(source_dir))
    voice_json = onnx_path.with_suffix(".onnx.json")
    if not voice_json.is_file():
        voice_json = Path(str(onnx_path) + ".json")
    voice = json.loads(voice_json.read_text(encoding="utf-8"))
    if int(voice.get("num_speakers", 1)) > 1:
        raise ValueError(f"{onnx_path.name}: multi-speaker Piper voices are not supported")
    progress(0, 3)
    weights, convs = read_voice(onnx_path)
    progress(1, 3)
    config = model_config(weights, convs, voice)
    arrays = {k: mx.array(v) for k, v in to_mlx_layout(weights, convs).items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays)
    progress(2, 3)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (out_dir / "voice.json").write_text(
        json.dumps(voice, ensure_ascii=False, indent=2), encoding="utf-8"
    )
    (out_dir / "source.txt").write_text(str(onnx_path) + "\n", encoding="utf-8")
    progress(3, 3)
