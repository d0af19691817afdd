"""Audio formats of the Realtime protocol: PCM16 24 kHz and G.711 μ-law/A-law 8 kHz.

The engine works on float32 mono at 16 kHz; the client speaks one of the wire formats.
Decoding turns wire bytes into float32 at the wire rate, `StreamResampler` carries the
rate change across chunk boundaries without clicks (soxr keeps filter state).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np
import soxr
from numpy.typing import NDArray

__all__ = [
    "AudioFormat",
    "AudioFormatError",
    "ENGINE_RATE",
    "MEDIA_PCM",
    "PCM16",
    "PCMA",
    "PCMU",
    "Samples",
    "StreamResampler",
    "decode_base64",
    "format_from_beta",
    "format_from_ga",
    "resample",
]

ENGINE_RATE = 16000
# Audio as the gateway computes on it: float32 mono in [-1, 1].
Samples = NDArray[np.float32]


class AudioFormatError(ValueError):
    """Audio bytes or a format description the gateway cannot take."""


@dataclass(frozen=True)
class AudioFormat:
    """One wire format: `ga_type` and `beta_name` are its two protocol spellings."""

    ga_type: str
    beta_name: str
    rate: int
    sample_bytes: int

    @property
    def bytes_per_ms(self) -> float:
        return self.rate * self.sample_bytes / 1000

    def ga_shape(self) -> dict[str, object]:
        if self.ga_type == "audio/pcm":
            return {"type": self.ga_type, "rate": self.rate}
        return {"type": self.ga_type}

    def decode(self, data: bytes) -> Samples:
        """Wire bytes to float32 in [-1, 1] at `self.rate`."""
        if len(data) % self.sample_bytes:
            raise AudioFormatError(
                f"{self.beta_name} audio must be a whole number of {self.sample_bytes}-byte "
                f"samples, got {len(data)} bytes"
            )
        if self.ga_type == PCM16.ga_type:
            pcm = np.frombuffer(data, dtype="<i2")
        else:
            table = _ULAW_DECODE if self is PCMU else _ALAW_DECODE
            pcm = table[np.frombuffer(data, dtype=np.uint8)]
        samples: Samples = pcm.astype(np.float32) / np.float32(32768.0)
        return samples

    def encode(self, samples: NDArray[np.floating]) -> bytes:
        """Float32 in [-1, 1] at `self.rate` to wire bytes."""
        pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)
        if self.ga_type == PCM16.ga_type:
            return pcm.astype("<i2").tobytes()
        encoder = _ulaw_encode if self is PCMU else _alaw_encode
        return encoder(pcm).tobytes()

    def duration_ms(self, num_bytes: int) -> float:
        return num_bytes / self.bytes_per_ms


PCM16 = AudioFormat("audio/pcm", "pcm16", 24000, 2)
PCMU = AudioFormat("audio/pcmu", "g711_ulaw", 8000, 1)
PCMA = AudioFormat("audio/pcma", "g711_alaw", 8000, 1)
# A WebRTC call's audio as its Opus codec decodes and encodes it: PCM16 at 48 kHz, mono.
# Never named by a client: it stands for the RTP track, whatever the session's formats.
MEDIA_PCM = AudioFormat("audio/pcm", "pcm16", 48000, 2)
_FORMATS = (PCM16, PCMU, PCMA)


def format_from_ga(shape: dict[str, object]) -> AudioFormat:
    """The format named by a GA `{type, rate}` object; other rates are refused."""
    for fmt in _FORMATS:
        if shape.get("type") == fmt.ga_type:
            rate = shape.get("rate", fmt.rate)
            if rate != fmt.rate:
                raise AudioFormatError(f"{fmt.ga_type} is supported only at rate {fmt.rate}")
            return fmt
    raise AudioFormatError(f"unsupported audio format type {shape.get('type')!r}")


def format_from_beta(name: str) -> AudioFormat:
    for fmt in _FORMATS:
        if name == fmt.beta_name:
            return fmt
    raise AudioFormatError(f"unsupported audio format {name!r}")


def decode_base64(text: str) -> bytes:
    """Strict base64: a payload with stray characters is an error, not silently trimmed."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioFormatError(f"audio is not valid base64: {exc}") from None


def resample(samples: NDArray[np.floating], in_rate: int, out_rate: int) -> Samples:
    """One-shot resampling of a complete clip."""
    if in_rate == out_rate or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    resampled: Samples = soxr.resample(samples, in_rate, out_rate)
    return resampled.astype(np.float32, copy=False)


class StreamResampler:
    """Chunked resampling whose output equals resampling the concatenated input.

    The project's one streaming resampler: input audio to 16 kHz (`gateway.session.input_buffer`)
    and the voice's audio to the output format (`gateway.session.response_stream`), each stream
    through one instance. It holds back part of its output until more input, or
    `last=True`, arrives.
    """

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None
            if in_rate == out_rate
            else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32")
        )

    def push(self, samples: NDArray[np.floating], last: bool = False) -> Samples:
        chunk = samples.astype(np.float32, copy=False)
        if self._stream is None:
            return chunk
        resampled: Samples = self._stream.resample_chunk(chunk, last=last)
        return resampled


# G.711 per ITU-T: decode tables built once, encoders vectorised with numpy.
def _ulaw_decode_table() -> NDArray[np.int16]:
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign != 0, -magnitude, magnitude).astype(np.int16)


def _alaw_decode_table() -> NDArray[np.int16]:
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0)
    )
    return np.where(sign != 0, magnitude, -magnitude).astype(np.int16)


_ULAW_DECODE = _ulaw_decode_table()
_ALAW_DECODE = _alaw_decode_table()


def _ulaw_encode(pcm: NDArray[np.int16]) -> NDArray[np.uint8]:
    # 14-bit magnitude with the standard bias of 33; the arithmetic shift keeps the
    # reference encoder's rounding of negative samples.
    y = pcm.astype(np.int32) >> 2
    sign = np.where(y < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.abs(y), 8159) + 33
    segment = np.floor(np.log2(magnitude)).astype(np.int32) - 5
    mantissa = np.where(segment > 7, 0x0F, (magnitude >> (segment + 1)) & 0x0F)
    segment = np.minimum(segment, 7)
    codes: NDArray[np.uint8] = (((segment << 4) | mantissa) ^ sign).astype(np.uint8)
    return codes


def _alaw_encode(pcm: NDArray[np.int16]) -> NDArray[np.uint8]:
    # 13-bit magnitude; negative samples are one's-complemented as in the reference.
    y = pcm.astype(np.int32) >> 3
    mask = np.where(y >= 0, 0xD5, 0x55)
    magnitude = np.where(y >= 0, y, -y - 1)
    segment = np.clip(np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32) - 4, 0, 7)
    mantissa = np.where(segment < 2, magnitude >> 1, magnitude >> np.maximum(segment, 1)) & 0x0F
    return (((segment << 4) | mantissa) ^ mask).astype(np.uint8)
