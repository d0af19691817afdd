"""Wire audio formats: PCM16 and G.711, strict base64, streaming resampling."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.audio import (
    PCM16,
    PCMA,
    PCMU,
    AudioFormatError,
    StreamResampler,
    decode_base64,
    format_from_beta,
    format_from_ga,
    resample,
)


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
