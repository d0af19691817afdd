"""Whisper tiny.en ASR: CTranslate2 reader, MLX model, trimmed encoder, safeguards, stage."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from engine.llm.decoding_loops import repeated_tail
from engine.models import whisper, whisper_ct2
from engine.native import kernels
from engine.stages.asr import (
    MIN_SECONDS,
    AsrStage,
    Transcriber,
    Transcription,
    _Job,
    load_transcriber,
    split_long_audio,
)
from engine.stages.asr_request import AsrRequest
from engine.weights import registry
from tests.helpers import espeak, read_audio

RATE = 16000
ALSA = Path("/usr/share/sounds/alsa")

# Spoken by eSpeak NG (en-us, 150 words/min); tiny.en gets most of them word for word.
SENTENCES = [
    "Open the window, please.",
    "Can you remind me to call my mother tomorrow morning?",
    "How many people live in New York City?",
    "The children played in the park until the sun went down.",
    "My phone is on the kitchen table.",
    "We are going to the beach this weekend.",
    "Thank you very much for your help.",
    "The meeting has been moved to Monday afternoon.",
    "It is raining outside, so take an umbrella.",
    "She likes to walk her dog in the morning.",
]


def normalise(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def word_errors(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[:], i
        for j, h in enumerate(hyp, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (r != h))
    return row[-1]


def read_16k(path: Path) -> np.ndarray:
    return read_audio(path, RATE)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return registry.prepare("whisper-tiny.en", progress=False)


@pytest.fixture(scope="session")
def transcriber(model_dir: Path) -> Transcriber:
    return load_transcriber(model_dir)


@pytest.fixture(scope="session")
def full_window(model_dir: Path) -> Transcriber:
    # Pads beyond 30 s round every window up to Whisper's full 30 s window.
    return load_transcriber(model_dir, pad_s=30.0, fallback_pad_s=30.0)


@pytest.fixture(scope="session")
def naive(model_dir: Path) -> Transcriber:
    # Plain trimming with a short pad, the setting whose greedy decoding loops; a broken
    # transcript falls back straight to the full window.
    return load_transcriber(
        model_dir, pad_s=0.5, fallback_pad_s=0.5, silence_tail=False, min_window_s=0.0
    )


@pytest.fixture(scope="session")
def espeak_clips() -> list[np.ndarray]:
    return [espeak(sentence, RATE, "-v", "en-us", "-s", "150") for sentence in SENTENCES]


@pytest.fixture(scope="session")
def trimmed(transcriber: Transcriber, espeak_clips: list[np.ndarray]) -> list[Transcription]:
    return [transcriber.transcribe_detailed(clip) for clip in espeak_clips]


# ---------------------------------------------------------------- CTranslate2 reader


def _ct2_string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def _ct2_file(variables: dict[str, np.ndarray], aliases: dict[str, str], version=6) -> bytes:
    codes = {np.float32: 0, np.int8: 1, np.int16: 2, np.int32: 3, np.float16: 4}
    out = struct.pack("<I", version) + _ct2_string("WhisperSpec")
    out += struct.pack("<II", 3, len(variables))
    for name, value in variables.items():
        out += _ct2_string(name) + struct.pack("<B", value.ndim)
        out += struct.pack(f"<{value.ndim}I", *value.shape)
        out += struct.pack("<BI", codes[value.dtype.type], value.nbytes) + value.tobytes()
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases.items():
        out += _ct2_string(alias) + _ct2_string(target)
    return out


def test_read_ct2_parses_variables_dtypes_and_aliases(tmp_path: Path) -> None:
    variables = {
        "a/weight": np.arange(6, dtype=np.float16).reshape(2, 3),
        "a/bias": np.array([1.5, -2.0], np.float32),
        "heads": np.array(6, np.int32),
        "flag": np.array(1, np.int8),
    }
    path = tmp_path / "model.bin"
    path.write_bytes(_ct2_file(variables, {"b/weight": "a/weight"}))
    seen: list[tuple[int, int]] = []
    spec, read = whisper_ct2.read_ct2(path, lambda d, t: seen.append((d, t)))
    assert spec == "WhisperSpec"
    assert seen[-1] == (4, 4)
    for name, value in variables.items():
        assert read[name].dtype == value.dtype and np.array_equal(read[name], value)
    assert read["b/weight"] is read["a/weight"]


def test_read_ct2_rejects_other_versions_and_truncation(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(_ct2_file({"x": np.zeros(3, np.float32)}, {}, version=5))
    with pytest.raises(ValueError, match="version 5"):
        whisper_ct2.read_ct2(path)
    path.write_bytes(_ct2_file({"x": np.zeros(300, np.float32)}, {})[:-400])
    with pytest.raises(ValueError, match="truncated"):
        whisper_ct2.read_ct2(path)


def test_convert_rejects_missing_model(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model.bin"):
        whisper_ct2.convert(tmp_path, tmp_path / "out", lambda d, t: None)


@pytest.mark.models
def test_converted_directory_holds_weights_tokens_and_suppression(model_dir: Path) -> None:
    model, config = whisper.load_model(model_dir)  # strict: every parameter is present
    assert (config["n_audio_layer"], config["n_text_layer"], config["n_vocab"]) == (4, 4, 51864)
    assert (config["sot_id"], config["no_timestamps_id"], config["eot_id"]) == (50257, 50362, 50256)
    # English-only: no language or task token between the start and "no timestamps".
    assert config["start_ids"] == [50257, 50362]
    assert config["eot_id"] not in config["suppress_ids"]
    assert {50257, 50362, 50363, 51863} <= set(config["suppress_ids"])
    assert config["suppress_ids_begin"] == [220, 50256]
    attn = model.decoder.blocks[0].cross_attn
    assert "bias" not in attn.key and "bias" in attn.value  # Whisper keys have no bias


# ---------------------------------------------------------------- front end and model


def test_mel_filters_are_slaney_normalised() -> None:
    filters = whisper.mel_filters(80)
    assert filters.shape == (80, 201)
    assert (filters.sum(axis=1) > 0).all()
    # Each (wide) upper filter has unit area over frequency (40 Hz per FFT bin).
    assert np.allclose(filters[40:].sum(axis=1) * 40.0, 1.0, rtol=0.1)


def test_log_mel_rows_do_not_depend_on_how_many_are_computed() -> None:
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(RATE * 2)).astype(np.float32)
    mel = whisper.log_mel_spectrogram(audio)
    assert mel.shape == ((len(audio) + whisper.N_SAMPLES) // whisper.HOP_LENGTH, 80)
    # Log range clamped to 8 decades, scaled by 1/4 (up to float32 rounding of the two ends).
    assert mel.min() >= mel.max() - 2.0 - 1e-6
    for n in (150, 202, 250, whisper.N_FRAMES):
        assert np.array_equal(whisper.log_mel_spectrogram(audio, n_frames=n), mel[:n])


TINY = whisper.ModelArgs(
    n_mels=8, n_audio_ctx=20, n_audio_state=16, n_audio_head=2, n_audio_layer=2,
    n_vocab=50, n_text_ctx=16, n_text_state=16, n_text_head=2, n_text_layer=2,
)  # fmt: skip


def test_decoder_kv_cache_matches_recomputation() -> None:
    mx.random.seed(0)
    model = whisper.Model(TINY)
    model.encoder.positional_embedding = mx.random.normal((20, 16))
    model.decoder.positional_embedding = mx.random.normal((16, 16))
    features = model.encoder(mx.random.normal((2, 14, 8)))  # any even length fits
    assert features.shape == (2, 7, 16)
    kv = model.decoder.cross_kv(features)
    tokens = mx.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    full = model.decoder(tokens, kv, model.decoder.make_cache())
    cache = model.decoder.make_cache()
    steps = [model.decoder(tokens[:, :2], kv, cache)[:, -1]]
    steps += [model.decoder(tokens[:, i : i + 1], kv, cache)[:, -1] for i in range(2, 5)]
    assert mx.allclose(full[:, [1, 2, 3, 4]], mx.stack(steps, axis=1), atol=1e-4)


@pytest.mark.parametrize("frames", [14, 13])  # the stride-2 conv's phases, even and odd
def test_the_native_encoder_is_the_mlx_one(frames: int) -> None:
    assert kernels.load(), "the native kernels did not build (see the log)"
    mx.random.seed(1)
    model = whisper.Model(TINY)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters()))
    mel = mx.random.normal((2, frames, 8))  # a batch: each item alone
    mlx_features = np.array(model.encoder(mel))
    model.encoder.native = True
    native = np.array(model.encoder(mel))
    assert native.shape == mlx_features.shape == (2, (frames + 1) // 2, 16)
    np.testing.assert_allclose(native, mlx_features, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels_off", [False, True])
def test_a_loaded_encoder_takes_the_kernels_unless_they_are_off(
    kernels_off: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mx.random.seed(2)
    model = whisper.Model(TINY)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(TINY)))
    monkeypatch.setattr(kernels, "_lib", None)  # as in a fresh process
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path / "cache"))
    if kernels_off:
        monkeypatch.setenv(kernels.ENV, "0")
    loaded, _ = whisper.load_model(tmp_path)
    assert loaded.encoder.native is not kernels_off
    features = loaded.encoder(mx.random.normal((1, 14, 8)))
    assert features.shape == (1, 7, 16)


# ---------------------------------------------------------------- safeguards (unit)


def test_repeated_tail_finds_loops_only() -> None:
    assert repeated_tail([5, 1, 2, 1, 2, 1, 2]) == 2
    assert repeated_tail([9, 9, 9, 9, 9]) == 1
    assert repeated_tail([9, 9, 9, 9]) == 0
    assert repeated_tail([1, 2, 3, 1, 2, 3]) == 0
    assert repeated_tail(list(range(40))) == 0


def test_split_long_audio_cuts_at_a_quiet_point() -> None:
    rng = np.random.default_rng(1)
    audio = (0.3 * rng.standard_normal(RATE * 70)).astype(np.float32)
    quiet = int(25.0 * RATE)
    audio[quiet : quiet + RATE // 10] = 0.0
    parts = split_long_audio(audio, max_s=28.0)
    assert sum(len(p) for p in parts) == len(audio)
    assert all(len(p) <= 28 * RATE for p in parts)
    assert quiet <= len(parts[0]) <= quiet + RATE // 10
    assert len(split_long_audio(audio[: RATE * 5])) == 1


@pytest.mark.models
def test_the_decoder_reads_its_float16_weights_from_16_bit_twins_bit_for_bit(
    transcriber: Transcriber, espeak_clips: list[np.ndarray]
) -> None:
    # Whisper's weights are float16: every decoder matrix has a 16-bit twin, and a
    # transcription reads them with the same tokens and scores as the fp32 weights.
    from mlx.utils import tree_flatten

    from engine.native import gemv_forward

    if not gemv_forward.is_active():  # no forwarder (not Linux): plain fp32 products
        assert gemv_forward.live_twins() == 0
        return
    leaves: list[tuple[str, mx.array]] = tree_flatten(transcriber.model.decoder.parameters())
    assert gemv_forward.live_twins() >= sum(w.ndim == 2 for _, w in leaves)
    clip = espeak_clips[0]
    used = gemv_forward.twin_products()
    twinned = transcriber.transcribe_requests([AsrRequest(clip, logprobs=True)])[0]
    assert gemv_forward.twin_products() > used
    gemv_forward.use_twins(False)
    try:
        fp32 = transcriber.transcribe_requests([AsrRequest(clip, logprobs=True)])[0]
    finally:
        gemv_forward.use_twins(True)
    assert twinned.tokens == fp32.tokens and twinned.logprobs == fp32.logprobs


@pytest.mark.models
def test_token_cap_grows_with_duration(transcriber: Transcriber) -> None:
    assert transcriber._token_cap(1.0) < transcriber._token_cap(5.0) <= transcriber.max_tokens
    assert transcriber._token_cap(300.0) == transcriber.max_tokens == 222


# ---------------------------------------------------------------- real recordings


@pytest.mark.models
def test_front_center_recording(transcriber: Transcriber) -> None:
    assert normalise(transcriber.transcribe(read_16k(ALSA / "Front_Center.wav"))) == [
        "front",
        "center",
    ]


@pytest.mark.models
def test_espeak_sentences_word_error_rate(trimmed: list[Transcription]) -> None:
    texts = [t.text for t in trimmed]
    errors = sum(
        word_errors(normalise(r), normalise(h)) for r, h in zip(SENTENCES, texts, strict=True)
    )
    words = sum(len(normalise(r)) for r in SENTENCES)
    assert errors / words <= 0.10, list(zip(SENTENCES, texts, strict=True))


@pytest.mark.models
@pytest.mark.timeout(1800)  # ten 30 s encoder windows: minutes on a busy 2-core CPU
def test_trimmed_encoder_matches_full_window(
    full_window: Transcriber, espeak_clips: list[np.ndarray], trimmed: list[Transcription]
) -> None:
    full = full_window.transcribe_batch(espeak_clips)  # one batched pass: 30 s windows are slow
    for short, long in zip(trimmed, full, strict=True):
        assert short.window_frames < whisper.N_FRAMES // 4  # really trimmed
        assert long.window_frames == whisper.N_FRAMES
        assert normalise(long.text) == normalise(short.text)


@pytest.mark.models
def test_naive_trimming_loops_and_the_safeguards_recover(naive: Transcriber) -> None:
    for name, words in [("Front_Left", "front left"), ("Side_Left", "side left")]:
        result = naive.transcribe_detailed(read_16k(ALSA / f"{name}.wav"))
        assert result.attempts == 2, result  # the short window's transcript was rejected
        assert result.window_frames == whisper.N_FRAMES
        assert normalise(result.text) == words.split()


@pytest.mark.models
def test_token_cap_stops_a_looping_decode(naive: Transcriber) -> None:
    audio = read_16k(ALSA / "Side_Left.wav")
    mel = whisper.log_mel_spectrogram(audio)
    features = naive.model.encoder(mx.array(mel[None, :200]))
    cap = naive._token_cap(len(audio) / RATE)
    job = _Job(audio=audio, duration_s=len(audio) / RATE, context=list(naive.prompt))
    [out] = naive._decode(naive.model.decoder.cross_kv(features), [job], stop_on_loop=[False])
    assert (len(out.tokens), out.broken) == (cap, "token cap")
    [out] = naive._decode(naive.model.decoder.cross_kv(features), [job], stop_on_loop=[True])
    assert out.broken == "repetition" and len(out.tokens) < cap


@pytest.mark.models
def test_every_alsa_recording_ends_without_a_loop(transcriber: Transcriber) -> None:
    for path in sorted(ALSA.glob("*.wav")):
        result = transcriber.transcribe_detailed(read_16k(path))
        assert repeated_tail(result.tokens) == 0, (path.name, result.text)
        assert len(result.tokens) <= transcriber._token_cap(result.duration_s)


@pytest.mark.models
def test_batch_matches_single(transcriber: Transcriber, espeak_clips: list[np.ndarray]) -> None:
    clips = [espeak_clips[1], read_16k(ALSA / "Rear_Left.wav"), espeak_clips[6]]
    batched = transcriber.transcribe_batch(clips)
    assert [b.text for b in batched] == [transcriber.transcribe(c) for c in clips]


@pytest.mark.models
def test_beam_search_hears_no_worse_and_leaves_partials_greedy(
    model_dir: Path,
    transcriber: Transcriber,
    espeak_clips: list[np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    beams = load_transcriber(model_dir, beam_size=5)
    greedy = [normalise(t.text) for t in transcriber.transcribe_batch(espeak_clips)]
    searched = [normalise(t.text) for t in beams.transcribe_batch(espeak_clips)]

    def errors(heard: list[list[str]]) -> int:
        refs = [normalise(s) for s in SENTENCES]
        return sum(word_errors(r, h) for r, h in zip(refs, heard, strict=True))

    assert errors(searched) <= errors(greedy), list(zip(greedy, searched, strict=True))
    clip = read_16k(ALSA / "Front_Center.wav")
    final, partial = beams.transcribe_requests(
        [AsrRequest(clip, logprobs=True), AsrRequest(clip, logprobs=True, partial=True)]
    )
    assert normalise(final.text) == ["front", "center"]
    assert len(final.logprobs) == len(final.tokens) and all(lp <= 0 for lp in final.logprobs)
    [plain] = transcriber.transcribe_requests([AsrRequest(clip, logprobs=True, partial=True)])
    # The same greedy decode; the encoder ran the two requests in one batch here, alone
    # there, so the scores agree to float rounding.
    assert partial.tokens == plain.tokens
    assert partial.logprobs == pytest.approx(plain.logprobs, abs=1e-3)

    def no_beams(*args: object) -> None:
        raise AssertionError("a greedy request went to the beam search")

    monkeypatch.setattr(beams, "_beam", no_beams)
    [check] = beams.transcribe_requests([AsrRequest(clip, greedy=True)])
    assert normalise(check.text) == ["front", "center"]


@pytest.mark.models
def test_empty_and_too_short_audio_give_empty_text(transcriber: Transcriber) -> None:
    for audio in [np.zeros(0, np.float32), np.full(int(MIN_SECONDS * RATE) - 1, 0.2, np.float32)]:
        result = transcriber.transcribe_detailed(audio)
        assert (result.text, result.attempts) == ("", 0)


@pytest.mark.models
def test_bad_audio_is_rejected(transcriber: Transcriber) -> None:
    with pytest.raises(ValueError, match="mono"):
        transcriber.transcribe(np.zeros((2, 1600), np.float32))
    with pytest.raises(ValueError, match="float"):
        transcriber.transcribe(np.zeros(1600, np.int16))
    with pytest.raises(ValueError, match="NaN"):
        transcriber.transcribe(np.full(1600, np.nan, np.float32))


@pytest.mark.models
def test_audio_longer_than_30_s_is_transcribed_in_parts(
    transcriber: Transcriber, espeak_clips: list[np.ndarray]
) -> None:
    gap = np.zeros(int(0.6 * RATE), np.float32)
    long = np.concatenate([x for clip in espeak_clips for x in (clip, gap)])
    assert len(long) > 30 * RATE
    result = transcriber.transcribe_detailed(long)
    ref = normalise(" ".join(SENTENCES))
    assert word_errors(ref, normalise(result.text)) / len(ref) <= 0.15, result.text


# ---------------------------------------------------------------- stage


@pytest.mark.models
def test_stage_batches_aborts_and_reports(
    transcriber: Transcriber, espeak_clips: list[np.ndarray], trimmed: list[Transcription]
) -> None:
    stage = AsrStage(transcriber, max_batch=2)
    assert stage.name == "asr" and not stage.has_work()
    for i in range(4):
        stage.add(f"r{i}", espeak_clips[i])
    stage.abort("r1")
    first = stage.step()
    assert [o.request_id for o in first] == ["r0", "r2"]
    second = stage.step()
    assert [o.request_id for o in second] == ["r3"] and not stage.has_work()
    assert stage.step() == []
    for out in first + second:
        i = int(out.request_id[1:])
        assert out.finished and out.error is None
        assert normalise(out.payload) == normalise(trimmed[i].text)
        assert out.metrics["asr_ms"] > 0 and out.metrics["audio_s"] > 1.0


@pytest.mark.models
def test_stage_rejects_bad_requests(transcriber: Transcriber) -> None:
    stage = AsrStage(transcriber)
    stage.add("a", np.zeros(1600, np.float32))
    with pytest.raises(ValueError, match="already"):
        stage.add("a", np.zeros(1600, np.float32))
    with pytest.raises(ValueError, match="numpy array or an AsrRequest"):
        stage.add("b", [0.0] * 1600)
    with pytest.raises(ValueError, match="mono"):
        stage.add("c", np.zeros((1600, 2), np.float32))
    with pytest.raises(ValueError, match="max_batch"):
        AsrStage(transcriber, max_batch=0)
    [out] = stage.step()
    assert out.request_id == "a" and out.finished and out.error is None
