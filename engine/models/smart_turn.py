"""Smart Turn v3.2 on MLX: does the speech so far sound like a finished turn?

The model (pipecat's BSD-2-Clause `smart-turn-v3.2-cpu.onnx`) reads the last 8 s of
16 kHz audio as 80 x 800 Whisper log-mel features, runs a Whisper-tiny-sized encoder,
pools its 400 frames with a learned attention and gives the probability that the turn is
complete.

The published file is statically quantised: int8 weights, and every activation passes a
uint8 quantise/dequantise pair with calibrated scales. The MLX model keeps those pairs
(`FakeQuant`) at the same places and computes each quantised product as onnxruntime's
fused kernels do (exact integer sums, one float multiplier, its softmax's floor(1/scale)),
so silence scores the same to the last bit and each layer's integer outputs agree.

They do not agree to 1e-3 on speech, and cannot without bit-identical float LayerNorm
and erf: a last-bit difference there moves a value across a rounding step now and then,
and 16 quantised layers amplify such steps. onnxruntime disagrees with itself the same
way: on the 20 test clips its unoptimised graph differs from its fused one by 0.044 on
average (0.19 at most), and this model differs from the fused one by about as much
(tests/test_smart_turn.py measures both). `convert` reads the ONNX initializers with the
`onnx` package; nothing of pipecat's own code or dependencies is needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.models.whisper import HOP_LENGTH, N_FFT, SAMPLE_RATE, _hann, mel_filters

__all__ = [
    "CONVERTER_VERSION",
    "N_FRAMES",
    "WINDOW_SAMPLES",
    "Model",
    "convert",
    "features",
    "find_onnx",
    "load",
]

CONVERTER_VERSION = "1"
ONNX_RELATIVE = Path("audio") / "turn" / "smart_turn" / "data" / "smart-turn-v3.2-cpu.onnx"
WINDOW_SAMPLES = 8 * SAMPLE_RATE
N_FRAMES = WINDOW_SAMPLES // HOP_LENGTH  # 800
N_MELS = 80
D_MODEL = 384
N_HEADS = 6
N_LAYERS = 4
POOL_HIDDEN = 256
HEAD_HIDDEN = (256, 64)


# --- features: what pipecat computes before calling the ONNX model ---


def features(audio: np.ndarray) -> np.ndarray:
    """(800, 80) log-mel frames of the last 8 s of `audio` (16 kHz float), zero-padded in
    front; the frames-major transpose of pipecat's `(80, 800)` input.

    Differs from Whisper's own front end (`whisper.log_mel_spectrogram`) in three ways
    the model was trained with: the 8 s window is normalised to zero mean and unit
    variance first, the spectrogram is centred with reflection at both ends of the
    window (not followed by silence), and the last of its 801 frames is dropped.
    """
    x = np.asarray(audio, np.float32)[-WINDOW_SAMPLES:]
    x = np.pad(x, (WINDOW_SAMPLES - len(x), 0))
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH]
    power = np.abs(np.fft.rfft(frames * _hann(N_FFT).astype(np.float64), axis=-1)) ** 2
    mel = np.einsum("tk,mk->tm", power, mel_filters(N_MELS).astype(np.float64))
    log_spec = np.log10(np.maximum(mel, 1e-10))[:-1]
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


# --- model ---


class FakeQuant(nn.Module):
    """A uint8 quantise/dequantise pair: ONNX QuantizeLinear then DequantizeLinear."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = mx.ones((1,))
        self.zero_point = mx.zeros((1,))

    def __call__(self, x: mx.array) -> mx.array:
        return self.requantize(x / self.scale)

    def requantize(self, scaled: mx.array) -> mx.array:
        """Round values already divided by this quantiser's scale; dequantised."""
        q = mx.clip(mx.round(scaled) + self.zero_point, 0, 255)
        return (q - self.zero_point) * self.scale

    def codes(self, x: mx.array) -> mx.array:
        """The integers (zero point removed) a dequantised value of this quantiser holds."""
        return mx.round(x / self.scale)


class QuantSoftmax(FakeQuant):
    """A softmax over uint8 inputs giving uint8 outputs, as onnxruntime computes the
    fused QLinearSoftmax: the probabilities are scaled by floor(1 / scale), not by
    1 / scale, before rounding."""

    def __call__(self, x: mx.array) -> mx.array:
        p = mx.softmax(x, axis=-1)
        q = mx.minimum(mx.round(p * mx.floor(1.0 / self.scale)) + self.zero_point, 255)
        return (q - self.zero_point) * self.scale


def gelu(x: mx.array) -> mx.array:
    """GELU in the exported graph's order of operations (so its rounding is the same)."""
    return x * ((mx.erf(x / np.float32(np.sqrt(2.0))) + 1.0) * 0.5)


def int_matmul(
    a: mx.array, a_q: FakeQuant, b: mx.array, b_q: FakeQuant, out: FakeQuant
) -> mx.array:
    """onnxruntime's QLinearMatMul of two quantised activations: the integer product,
    requantised with the float multiplier a_scale * b_scale / out_scale."""
    acc = a_q.codes(a) @ b_q.codes(b)
    return out.requantize(acc * (a_q.scale * b_q.scale / out.scale))


class QuantLinear(nn.Module):
    """A quantised MatMul (or Gemm) with int8 per-channel weights, computed as
    onnxruntime's fused kernels do: integer products, then one float multiplier.

    `weight` holds the int8 codes. The encoder's projections add their float `bias`
    after the product is requantised; the Gemm layers (`int_bias`) add an int32 bias to
    the accumulator before.
    """

    def __init__(self, n_in: int, n_out: int, *, bias: bool = True, int_bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((n_out, n_in))
        self.weight_scale = mx.ones((n_out,))
        if bias:
            self.bias = mx.zeros((n_out,))
        self.out = FakeQuant()
        self._int_bias = int_bias

    def __call__(self, x: mx.array, x_q: FakeQuant) -> mx.array:
        acc = x_q.codes(x) @ self.weight.T
        has_bias = "bias" in self
        if has_bias and self._int_bias:
            acc = acc + self.bias
        y = self.out.requantize(acc * (x_q.scale * self.weight_scale / self.out.scale))
        return y + self.bias if has_bias and not self._int_bias else y


class QuantConv1d(nn.Module):
    """onnxruntime's QLinearConv: int8 per-channel weights (O, K, I), an int32 bias."""

    def __init__(self, n_in: int, n_out: int, *, stride: int) -> None:
        super().__init__()
        self.weight = mx.zeros((n_out, 3, n_in))
        self.weight_scale = mx.ones((n_out,))
        self.bias = mx.zeros((n_out,))
        self.out = FakeQuant()
        self._stride = stride

    def __call__(self, x: mx.array, x_q: FakeQuant) -> mx.array:
        acc = mx.conv1d(x_q.codes(x), self.weight, stride=self._stride, padding=1) + self.bias
        return self.out.requantize(acc * (x_q.scale * self.weight_scale / self.out.scale))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = QuantLinear(D_MODEL, D_MODEL)
        self.k_proj = QuantLinear(D_MODEL, D_MODEL, bias=False)
        self.v_proj = QuantLinear(D_MODEL, D_MODEL)
        self.out_proj = QuantLinear(D_MODEL, D_MODEL)
        # Where the export quantised the attention's intermediate values.
        self.q_scaled = FakeQuant()
        self.k_scaled = FakeQuant()
        self.v_heads = FakeQuant()
        self.scores = FakeQuant()
        self.weights = QuantSoftmax()
        self.context = FakeQuant()
        self.merged = FakeQuant()

    def __call__(self, x: mx.array, x_q: FakeQuant) -> mx.array:
        B, L, _ = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(B, L, N_HEADS, -1).transpose(0, 2, 1, 3)

        # The 1/sqrt(head_dim) scale is split evenly between queries and keys.
        scale = (D_MODEL // N_HEADS) ** -0.25
        q = self.q_scaled(heads(self.q_proj(x, x_q)) * scale)
        k = self.k_scaled(heads(self.k_proj(x, x_q)) * scale)
        v = self.v_heads(heads(self.v_proj(x, x_q)))
        scores = int_matmul(q, self.q_scaled, k.transpose(0, 1, 3, 2), self.k_scaled, self.scores)
        w = self.weights(scores)
        o = int_matmul(w, self.weights, v, self.v_heads, self.context)
        o = self.merged(o.transpose(0, 2, 1, 3).reshape(B, L, D_MODEL))
        return self.out_proj(o, self.merged)


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(D_MODEL)
        self.attn_in = FakeQuant()
        self.self_attn = Attention()
        self.final_layer_norm = nn.LayerNorm(D_MODEL)
        self.mlp_in = FakeQuant()
        self.fc1 = QuantLinear(D_MODEL, 4 * D_MODEL)
        self.mlp_act = FakeQuant()
        self.fc2 = QuantLinear(4 * D_MODEL, D_MODEL)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.attn_in(self.self_attn_layer_norm(x)), self.attn_in)
        h = self.fc1(self.mlp_in(self.final_layer_norm(x)), self.mlp_in)
        return x + self.fc2(self.mlp_act(gelu(h)), self.mlp_act)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input = FakeQuant()
        self.conv1 = QuantConv1d(N_MELS, D_MODEL, stride=1)
        self.conv1_act = FakeQuant()
        self.conv2 = QuantConv1d(D_MODEL, D_MODEL, stride=2)
        self.embed_positions = mx.zeros((N_FRAMES // 2, D_MODEL))
        self.layers = [EncoderLayer() for _ in range(N_LAYERS)]
        self.layer_norm = nn.LayerNorm(D_MODEL)
        self.encoded = FakeQuant()
        self.pool1 = QuantLinear(D_MODEL, POOL_HIDDEN)
        self.pool_act = FakeQuant()
        self.pool2 = QuantLinear(POOL_HIDDEN, 1)
        self.pooled = FakeQuant()
        self.head1 = QuantLinear(D_MODEL, HEAD_HIDDEN[0], int_bias=True)
        self.head_norm = nn.LayerNorm(HEAD_HIDDEN[0])
        self.head1_act = FakeQuant()
        self.head2 = QuantLinear(*HEAD_HIDDEN, int_bias=True)
        self.head2_act = FakeQuant()
        self.head3 = QuantLinear(HEAD_HIDDEN[1], 1, int_bias=True)

    def __call__(self, mel: mx.array) -> mx.array:
        """mel: (B, 800, 80) from `features`; returns (B,) turn-complete probabilities."""
        x = self.conv1_act(gelu(self.conv1(self.input(mel), self.input)))
        x = gelu(self.conv2(x, self.conv1_act)) + self.embed_positions
        for layer in self.layers:
            x = layer(x)
        h = self.encoded(self.layer_norm(x))
        # Attention pooling: a softmax over the frames weighs each frame's state.
        t = self.pool_act(mx.tanh(self.pool1(h, self.encoded)))
        weights = mx.softmax(self.pool2(t, self.pool_act), axis=1)
        pooled = self.pooled((h * weights).sum(axis=1))
        y = self.head1_act(gelu(self.head_norm(self.head1(pooled, self.pooled))))
        y = self.head2_act(gelu(self.head2(y, self.head1_act)))
        return mx.sigmoid(self.head3(y, self.head2_act))[:, 0]


def load(model_dir: Path) -> Model:
    model = Model()
    model.load_weights(str(Path(model_dir) / "model.safetensors"), strict=True)
    mx.eval(model.parameters())
    return model


# --- conversion from the ONNX file ---


def find_onnx(package_dir: Path) -> Path:
    """The ONNX file inside an unpacked `pipecat` package directory (or its parent)."""
    for root in (Path(package_dir), Path(package_dir) / "pipecat"):
        if (root / ONNX_RELATIVE).is_file():
            return root / ONNX_RELATIVE
    raise FileNotFoundError(f"no {ONNX_RELATIVE.name} under {package_dir}")


# The activations quantised in one encoder layer, in the order the export quantises them
# (with the ONNX op that produces each), and their place in the MLX model.
_LAYER_QUANTS = (
    ("LayerNormalization", "attn_in"),
    ("MatMul", "self_attn.{k}"),
    ("MatMul", "self_attn.{q}"),
    ("MatMul", "self_attn.{v}"),
    ("Transpose", "self_attn.v_heads"),
    ("Mul", "self_attn.q_scaled"),
    ("Mul", "self_attn.k_scaled"),
    ("MatMul", "self_attn.scores"),
    ("Softmax", "self_attn.weights"),
    ("MatMul", "self_attn.context"),
    ("Reshape", "self_attn.merged"),
    ("MatMul", "self_attn.out_proj.out"),
    ("LayerNormalization", "mlp_in"),
    ("MatMul", "fc1.out"),
    ("Mul", "mlp_act"),
    ("MatMul", "fc2.out"),
)
_INPUT_QUANTS = (
    ("input", "input"),
    ("Conv", "conv1.out"),
    ("Mul", "conv1_act"),
    ("Conv", "conv2.out"),
)
_HEAD_QUANTS = (
    ("LayerNormalization", "encoded"),
    ("MatMul", "pool1.out"),
    ("Tanh", "pool_act"),
    ("MatMul", "pool2.out"),
    ("ReduceSum", "pooled"),
    ("Gemm", "head1.out"),
    ("Mul", "head1_act"),
    ("Gemm", "head2.out"),
    ("Mul", "head2_act"),
    ("Gemm", "head3.out"),
)
# The weight-bearing ops in graph order, and their MLX names.
_LAYER_WEIGHTS = (
    "self_attn.{k}",
    "self_attn.{q}",
    "self_attn.{v}",
    "self_attn.out_proj",
    "fc1",
    "fc2",
)


class _Graph:
    """The ONNX graph with its constant tensors dequantised to float32."""

    def __init__(self, path: Path) -> None:
        import onnx
        from onnx import numpy_helper

        graph = onnx.load(str(path)).graph
        self.nodes = list(graph.node)
        self.consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.producer = {out: n for n in self.nodes for out in n.output}
        # Constant int8 weights and int32 biases: their codes (zero point removed) and
        # their scales, by the name of the dequantised tensor.
        self.quantised: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for node in self.nodes:
            if node.op_type == "DequantizeLinear" and node.input[0] in self.consts:
                self.quantised[node.output[0]] = self._codes(node)
        self.values = {**self.consts, **{k: c * s for k, (c, s) in self.quantised.items()}}

    def _codes(self, node: object) -> tuple[np.ndarray, np.ndarray]:
        q, scale, zero = (self.consts[name] for name in node.input)  # type: ignore[attr-defined]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)  # type: ignore[attr-defined]
        shape = [1] * q.ndim
        if scale.size > 1:  # per channel along `axis`
            shape[axis] = -1
        codes = q.astype(np.float32) - zero.astype(np.float32).reshape(shape)
        return codes, scale.astype(np.float32).reshape(shape)

    def consumers(self, tensor: str) -> list:
        return [n for n in self.nodes if tensor in n.input]

    def activation_quants(self) -> list[tuple[str, float, float, str]]:
        """(producing op, scale, zero point, quantised tensor) of every quantised
        activation, in graph order."""
        found = []
        for node in self.nodes:
            if node.op_type != "QuantizeLinear" or node.input[0] in self.consts:
                continue
            source = self.producer.get(node.input[0])
            op = source.op_type if source is not None else "input"
            scale, zero = (float(self.consts[name]) for name in node.input[1:])
            found.append((op, scale, zero, node.output[0]))
        return found

    def matmul_slot(self, quantised: str) -> int | None:
        """Which input (0 or 1) of a MatMul the dequantised `quantised` tensor is."""
        for dq in self.consumers(quantised):
            for user in self.consumers(dq.output[0]):
                if user.op_type == "MatMul":
                    return list(user.input).index(dq.output[0])
        return None

    def weight_ops(self) -> list:
        """MatMul, Gemm and Conv nodes whose second input is a constant weight."""
        return [
            n
            for n in self.nodes
            if n.op_type in ("MatMul", "Gemm", "Conv") and n.input[1] in self.values
        ]

    def bias_after(self, node: object) -> str | None:
        """The bias initializer added to `node`'s (quantised) output, if any."""
        tensor = node.output[0]  # type: ignore[attr-defined]
        for _ in range(3):  # MatMul -> QuantizeLinear -> DequantizeLinear -> Add
            following = self.consumers(tensor)
            if len(following) != 1:
                return None
            nxt = following[0]
            if nxt.op_type == "Add":
                return next((i for i in nxt.input if i in self.consts), None)
            tensor = nxt.output[0]
        return None


def _projection_names(graph: _Graph, matmuls: list) -> dict[str, str]:
    """Which of a layer's three input projections is q, k and v, from the biases they
    are followed by (k has none)."""
    names = {}
    for node, slot in zip(matmuls, "kqv", strict=True):
        bias = graph.bias_after(node) or ""
        names[slot] = "q_proj" if "q_proj" in bias else "v_proj" if "v_proj" in bias else "k_proj"
    if sorted(names.values()) != ["k_proj", "q_proj", "v_proj"]:
        raise ValueError(f"cannot tell the attention projections apart: {names}")
    return names


def read_weights(onnx_path: Path) -> dict[str, np.ndarray]:
    """The MLX model's parameters, by name, from the quantised ONNX graph."""
    graph = _Graph(onnx_path)
    v = graph.values
    out: dict[str, np.ndarray] = {}

    def put_weight(name: str, node: object, layout: Callable[[np.ndarray], np.ndarray]) -> None:
        codes, scale = graph.quantised[node.input[1]]  # type: ignore[attr-defined]
        out[f"{name}.weight"] = layout(codes)
        out[f"{name}.weight_scale"] = scale.reshape(-1)

    def put_int_bias(name: str, node: object) -> None:
        codes, _ = graph.quantised[node.input[2]]  # type: ignore[attr-defined]
        out[f"{name}.bias"] = codes

    ops = graph.weight_ops()
    if len(ops) != 2 + 6 * N_LAYERS + 5:
        raise ValueError(f"{onnx_path}: unexpected graph ({len(ops)} weight ops)")
    conv1, conv2, *encoder = ops[: 2 + 6 * N_LAYERS]
    pool1, pool2, head1, head2, head3 = ops[2 + 6 * N_LAYERS :]
    for name, node in (("conv1", conv1), ("conv2", conv2)):
        put_weight(name, node, lambda w: w.transpose(0, 2, 1))  # (O, I, K) -> (O, K, I)
        put_int_bias(name, node)
    out["embed_positions"] = v["inner.encoder.embed_positions.weight"]
    layer_names = []
    for i in range(N_LAYERS):
        nodes = encoder[6 * i : 6 * i + 6]
        slots = _projection_names(graph, nodes[:3])
        layer_names.append(slots)
        prefix = f"inner.encoder.layers.{i}"
        for template, node in zip(_LAYER_WEIGHTS, nodes, strict=True):
            name = f"layers.{i}." + template.format(**slots)
            put_weight(name, node, np.transpose)  # MatMul's (in, out) -> (out, in)
            bias = graph.bias_after(node)
            if bias is not None:
                out[f"{name}.bias"] = v[bias]
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            for p in ("weight", "bias"):
                out[f"layers.{i}.{norm}.{p}"] = v[f"{prefix}.{norm}.{p}"]
    for p in ("weight", "bias"):
        out[f"layer_norm.{p}"] = v[f"inner.encoder.layer_norm.{p}"]
        out[f"head_norm.{p}"] = v[f"inner.classifier.1.{p}"]
    for name, node in (("pool1", pool1), ("pool2", pool2)):
        put_weight(name, node, np.transpose)
        out[f"{name}.bias"] = v[graph.bias_after(node) or ""]
    for name, node in (("head1", head1), ("head2", head2), ("head3", head3)):
        put_weight(name, node, np.asarray)  # Gemm with transB: already (out, in)
        put_int_bias(name, node)
    out.update(_activation_quants(graph, layer_names))
    return {k: np.ascontiguousarray(a, dtype=np.float32) for k, a in out.items()}


def _activation_quants(graph: _Graph, layer_names: list[dict[str, str]]) -> dict[str, np.ndarray]:
    expected: list[tuple[str, str]] = list(_INPUT_QUANTS)
    for i, slots in enumerate(layer_names):
        for op, template in _LAYER_QUANTS:
            name = template.format(**{s: f"{p}.out" for s, p in slots.items()})
            expected.append((op, f"layers.{i}.{name}"))
    expected += _HEAD_QUANTS
    found = graph.activation_quants()
    ops = [op for op, _ in expected]
    if [op for op, *_ in found] != ops:
        raise ValueError("the quantised activations are not those of Smart Turn v3.2")
    out = {}
    for (_, name), (_, scale, zero, tensor) in zip(expected, found, strict=True):
        # The scaled queries and keys are both a Mul: the scores' MatMul tells them apart.
        if name.endswith(("q_scaled", "k_scaled")):
            slot = graph.matmul_slot(tensor)
            name = name[: -len("q_scaled")] + ("q_scaled" if slot == 0 else "k_scaled")
        out[f"{name}.scale"] = np.array([scale], np.float32)
        out[f"{name}.zero_point"] = np.array([zero], np.float32)
    return out


def convert(source_dir: Path, out_dir: Path, progress: Callable[[int, int], None]) -> None:
    """Write `model.safetensors` and `config.json` for `load` into `out_dir`."""
    progress(0, 2)
    weights = read_weights(find_onnx(source_dir))
    progress(1, 2)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out_dir / "model.safetensors"), {k: mx.array(a) for k, a in weights.items()}
    )
    config = {"model_type": "smart_turn", "version": "3.2", "sample_rate": SAMPLE_RATE}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    progress(2, 2)
