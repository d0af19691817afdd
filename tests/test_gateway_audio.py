"""Wire audio formats: PCM16 and G.711, strict base64, streaming resampling; the input
buffer that decodes and resamples each appended frame once."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.protocol.audio import (
    PCM16,
    PCMA,
    PCMU,
    AudioFormat,
    AudioFormatError,
    StreamResampler,
    decode_base64,
    format_from_beta,
    format_from_ga,
    resample,
)
from gateway.session import input_buffer
from gateway.session.input_buffer import BufferFullError, InputBuffer


def test_g711_known_codes() -> None:
    # ITU-T G.711 reference values: silence and full scale in both laws.
    assert PCMU.encode(np.zeros(1)) == b"\xff"
    assert PCMA.encode(np.zeros(1)) == b"\xd5"
    assert PCMU.encode(np.array([1.0])) == b"\x80"
    assert PCMU.encode(np.array([-1.0])) == b"\x00"
    assert PCMA.encode(np.array([1.0])) == b"\xaa"
    assert PCMA.encode(np.array([-1.0])) == b"\x2a"
    assert PCMU.decode(b"\x80")[0] == pytest.approx(32124 / 32768)
    assert PCMA.decode(b"\xaa")[0] == pytest.approx(32256 / 32768)


@pytest.mark.parametrize("fmt", [PCMU, PCMA])
def test_g711_round_trip_within_quantisation(fmt: object) -> None:
    x = np.linspace(-0.9, 0.9, 2001)
    y = fmt.decode(fmt.encode(x))
    # Logarithmic quantisation: relative error under ~7 %, absolute near zero.
    assert np.all(np.abs(y - x) <= 0.07 * np.abs(x) + 2e-3)
    assert all(
        fmt.decode(bytes([c]))[0] == fmt.decode(fmt.encode(fmt.decode(bytes([c]))))[0]
        for c in range(256)
    )


def test_pcm16_round_trip_and_odd_bytes() -> None:
    x = np.array([0.0, 0.5, -0.5, 0.999], dtype=np.float32)
    assert np.allclose(PCM16.decode(PCM16.encode(x)), x, atol=1 / 32768)
    with pytest.raises(AudioFormatError):
        PCM16.decode(b"\x00\x01\x02")
    assert PCM16.duration_ms(4800) == 100 and PCMU.duration_ms(800) == 100


def test_strict_base64() -> None:
    assert decode_base64("AAEC") == b"\x00\x01\x02"
    for bad in ("AAE", "AA!C", "A A="):
        with pytest.raises(AudioFormatError):
            decode_base64(bad)


def test_format_names() -> None:
    assert format_from_ga({"type": "audio/pcm", "rate": 24000}) is PCM16
    assert format_from_ga({"type": "audio/pcmu"}) is PCMU
    assert format_from_beta("g711_alaw") is PCMA
    with pytest.raises(AudioFormatError):
        format_from_ga({"type": "audio/pcm", "rate": 16000})
    with pytest.raises(AudioFormatError):
        format_from_beta("opus")


def test_stream_resampler_matches_one_shot() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(24000).astype(np.float32) * 0.1
    stream = StreamResampler(24000, 16000)
    pieces = [stream.push(x[i : i + 1234]) for i in range(0, len(x), 1234)]
    pieces.append(stream.push(np.zeros(0, np.float32), last=True))
    chunked = np.concatenate(pieces)
    whole = resample(x, 24000, 16000)
    assert abs(len(chunked) - 16000) <= 2
    n = min(len(chunked), len(whole))
    assert np.max(np.abs(chunked[100 : n - 100] - whole[100 : n - 100])) < 1e-3


# ---- the input buffer: each frame decoded once, resampled once --------------------------


def tone(ms: int, fmt: AudioFormat = PCM16) -> bytes:
    t = np.arange(int(fmt.rate * ms / 1000)) / fmt.rate
    return fmt.encode(0.3 * np.sin(2 * np.pi * 220 * t))


def frames(data: bytes, fmt: AudioFormat, ms: int = 20) -> list[bytes]:
    step = int(fmt.rate * ms / 1000) * fmt.sample_bytes
    return [data[i : i + step] for i in range(0, len(data), step)]


def test_each_appended_frame_is_decoded_once_and_resampled_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded: list[int] = []
    pushed: list[int] = []
    real_decode = AudioFormat.decode

    def decode(fmt: AudioFormat, data: bytes) -> np.ndarray:
        decoded.append(len(data))
        return real_decode(fmt, data)

    class CountingResampler(StreamResampler):
        def push(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
            pushed.append(len(samples))
            return super().push(samples, last)

    monkeypatch.setattr(AudioFormat, "decode", decode)
    monkeypatch.setattr(input_buffer, "StreamResampler", CountingResampler)
    buffer = InputBuffer(PCM16)
    data = tone(1000)
    for frame in frames(data, PCM16):
        buffer.append(frame)
        buffer.take_fresh()
    prepared = buffer.peek(200, 1000)  # reaches the newest audio: flushes the resampler
    committed = buffer.take(200, 1000)
    assert len(decoded) == len(frames(data, PCM16)) and sum(decoded) == len(data)
    assert sum(pushed) == len(data) // 2  # every input sample went through once
    assert prepared.data == committed.data
    assert prepared.samples.tobytes() == committed.samples.tobytes()


@pytest.mark.parametrize("fmt", [PCM16, PCMU])
def test_clips_are_the_one_shot_resampling_of_their_span(fmt: AudioFormat) -> None:
    buffer = InputBuffer(fmt)
    data = tone(1000, fmt)
    for frame in frames(data, fmt):
        buffer.append(frame)
    clip = buffer.take(200, 900)
    assert clip.duration_ms == 700 and len(clip.samples) == 700 * 16
    whole = resample(fmt.decode(data), fmt.rate, 16000)
    assert np.allclose(clip.samples[50:-50], whole[3200 + 50 : 14400 - 50], atol=1e-5)
    assert buffer.start_ms == 900 and buffer.span_ms(0, 2000) == 100


@pytest.mark.parametrize("fmt", [PCM16, PCMU])
def test_samples_stay_on_the_clock_across_flushes(fmt: AudioFormat) -> None:
    buffer = InputBuffer(fmt)
    fed = 0
    for i, frame in enumerate(frames(tone(3000, fmt), fmt, ms=30)):
        buffer.append(frame)
        if i % 17 == 0:
            buffer.settle()  # as a commit or a prepared turn at the newest audio does
        fed += len(buffer.take_fresh())
    buffer.settle()
    fed += len(buffer.take_fresh())
    assert fed == round(buffer.now_ms * 16) == 48000


def test_trim_and_clear_drop_both_forms_of_the_audio() -> None:
    buffer = InputBuffer(PCM16)
    for frame in frames(tone(1000), PCM16):
        buffer.append(frame)
    buffer.trim(400)
    assert buffer.start_ms == 600
    clip = buffer.peek(0, buffer.now_ms)
    assert clip.duration_ms == 400 and len(clip.samples) == 400 * 16
    buffer.clear()
    assert buffer.empty and buffer.start_ms == 1000 and buffer.span_ms(0, 1000) <= 0
    buffer.append(tone(100))
    clip = buffer.take(0, buffer.now_ms)
    assert clip.duration_ms == 100 and len(clip.samples) == 100 * 16


def test_a_trimmed_buffer_keeps_the_newest_audio_exactly_as_its_ring_wraps() -> None:
    # Ten seconds through a buffer that keeps 1.5 s: its rings (sized for a second at
    # first) wrap many times; it holds the newest audio in both forms, as a buffer that
    # kept everything holds it.
    rng = np.random.default_rng(0)
    audio = PCM16.encode(0.3 * rng.uniform(-1, 1, PCM16.rate * 10))
    trimmed, whole = InputBuffer(PCM16), InputBuffer(PCM16)
    step = 960  # 20 ms of 24 kHz PCM16
    for at in range(0, len(audio), step):
        for buffer in (trimmed, whole):
            buffer.append(audio[at : at + step])
        trimmed.trim(1500)
        if at % (37 * step) == 0:
            clip = trimmed.peek(trimmed.start_ms, trimmed.now_ms)
            assert clip.data == audio[at + step - len(clip.data) : at + step]
            kept = whole.peek(trimmed.start_ms, trimmed.now_ms)
            assert np.array_equal(clip.samples, kept.samples)
    clip = trimmed.peek(0, trimmed.now_ms)
    assert clip.duration_ms == 1500 and clip.data == audio[-len(clip.data) :]
    assert np.array_equal(clip.samples, whole.peek(8500, 10000).samples)


def test_a_ring_holds_what_was_added_and_not_dropped() -> None:
    ring = input_buffer._Ring(np.int64, 4)
    held: list[int] = []
    counter = 0
    for add, drop in [(3, 1), (3, 2), (5, 0), (2, 6), (9, 3), (1, 7), (0, 0)]:
        values = np.arange(counter, counter + add)
        counter += add
        ring.extend(values)
        held += values.tolist()
        ring.drop(drop)
        held = held[drop:]
        assert len(ring) == len(held)
        assert ring.copy(0, len(ring)).tolist() == held
        assert ring.copy(1, len(ring) - 1).tolist() == held[1:-1]


def test_append_refuses_bad_audio_and_a_full_buffer_leaving_it_as_it_was() -> None:
    buffer = InputBuffer(PCM16)
    buffer.append(tone(100))
    with pytest.raises(AudioFormatError):
        buffer.append(b"\x00\x01\x02")
    with pytest.raises(BufferFullError):
        buffer.append(tone(100), limit_ms=150)
    assert buffer.now_ms == 100 and buffer.peek(0, 100).duration_ms == 100
