"""The input audio buffer of a realtime session, and the session's clock.

Rules of this module:

1. One clock: `now_ms` is the audio appended to the session so far, in ms. Every
   `*_ms` value of the session (VAD decisions, commits, truncation of input) is on it.
2. Each appended frame is decoded once and resampled once, by one streaming resampler,
   to 16 kHz float32. The buffer keeps both forms of the same audio: the wire bytes (the
   committed item holds them, as the client sent them) and the 16 kHz samples (for VAD,
   for a prepared turn and for the commit). A prepared turn and the commit of the same
   span read the same stored samples, so their turns carry equal audio.
3. The resampler holds back part of its output (filter look-ahead; soxr also emits in
   blocks, up to ~100 ms for 8 kHz input). A span that reaches into audio not resampled
   yet flushes the resampler: its tail is kept, cut or padded to end exactly at
   `now_ms` so the samples stay on the clock, and a fresh resampler takes the audio
   after it.
4. Samples produced by appends and flushes wait in `take_fresh()` for server VAD, so the
   VAD sees each sample once, in order.
5. With `processing` (echo cancellation, noise suppression: `gateway.session.input_processing`),
   the resampled samples pass through it before they are kept: everything that reads
   the 16 kHz samples hears the cleaned audio. It is a stream like the resampler, and
   is flushed with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.protocol.audio import ENGINE_RATE, AudioFormat, Samples, StreamResampler
from gateway.session.input_processing import InputProcessing

__all__ = ["BufferFullError", "Clip", "InputBuffer"]

_PER_MS = ENGINE_RATE / 1000  # 16 kHz samples per ms of the clock
_NO_SAMPLES: Samples = np.zeros(0, np.float32)


class BufferFullError(ValueError):
    """An append would take the buffer past its limit."""


@dataclass(frozen=True)
class Clip:
    """A span of the buffer in both forms: wire bytes in `fmt`, and 16 kHz samples."""

    data: bytes
    fmt: AudioFormat
    samples: Samples

    @property
    def duration_ms(self) -> float:
        return self.fmt.duration_ms(len(self.data))


class InputBuffer:
    """Uncommitted input audio from `start_ms` to `now_ms`."""

    def __init__(
        self,
        fmt: AudioFormat,
        now_ms: float = 0.0,
        processing: InputProcessing | None = None,
        held_ms: int = 1000,
    ) -> None:
        """`held_ms`: how much audio the buffer usually holds at most. Its rings are made
        that large at once (memory is touched only as audio fills it); they grow only
        past it, so sessions opened together do not all copy their audio at once."""
        self.fmt = fmt
        self.now_ms = now_ms
        self.start_ms = now_ms  # session time of the first buffered wire byte
        self._data = _Ring(np.uint8, round(held_ms * fmt.bytes_per_ms))
        self._samples = _Ring(np.float32, round(held_ms * _PER_MS))
        self._samples_start_ms = now_ms  # session time of the first kept 16 kHz sample
        self._resampler = StreamResampler(fmt.rate, ENGINE_RATE)
        self._processing = processing
        self._fresh: list[Samples] = []

    @property
    def empty(self) -> bool:
        return not len(self._data)

    def append(self, data: bytes, *, limit_ms: float | None = None) -> None:
        """Add one frame of wire bytes. Raises AudioFormatError, or BufferFullError if the
        buffer would then hold more than `limit_ms`; either way nothing changes."""
        samples = self.fmt.decode(data)
        if limit_ms is not None and self.fmt.duration_ms(len(self._data) + len(data)) > limit_ms:
            raise BufferFullError(f"the buffer holds at most {limit_ms} ms")
        self._data.extend(np.frombuffer(data, np.uint8))
        self.now_ms += self.fmt.duration_ms(len(data))
        self._keep(self._to_engine(samples))

    def take_fresh(self) -> Samples:
        """The 16 kHz samples produced since the last call, in order."""
        fresh, self._fresh = self._fresh, []
        return np.concatenate(fresh) if fresh else _NO_SAMPLES

    def span_ms(self, start_ms: float, end_ms: float) -> float:
        """How much buffered audio lies in [start_ms, end_ms); negative if none."""
        return min(end_ms, self.now_ms) - max(start_ms, self.start_ms)

    def peek(self, start_ms: float, end_ms: float) -> Clip:
        """The buffered audio in [start_ms, end_ms), cut on whole wire samples."""
        return self._clip(*self._byte_span(start_ms, end_ms))

    def take(self, start_ms: float, end_ms: float) -> Clip:
        """Remove and return the audio in [start_ms, end_ms); later audio stays."""
        lo, hi = self._byte_span(start_ms, end_ms)
        clip = self._clip(lo, hi)
        self._drop_before(self._time_of(hi))
        return clip

    def trim(self, keep_ms: float) -> None:
        """Keep at most the newest `keep_ms` of audio."""
        step = self.fmt.sample_bytes
        keep = int(keep_ms * self.fmt.bytes_per_ms) // step * step
        if len(self._data) > keep:
            self._drop_before(self._time_of(len(self._data) - keep))

    def clear(self) -> None:
        self._drop_before(self.now_ms)

    def settle(self) -> None:
        """Flush the resampler: every appended sample is resampled and kept (rule 3)."""
        tail = self._to_engine(_NO_SAMPLES, last=True)
        missing = max(round((self.now_ms - self._samples_end_ms) * _PER_MS), 0)
        if len(tail) > missing:
            tail = tail[:missing]
        elif len(tail) < missing:
            tail = np.concatenate([tail, np.zeros(missing - len(tail), np.float32)])
        self._keep(tail)
        self._resampler = StreamResampler(self.fmt.rate, ENGINE_RATE)
        if self._processing is not None:
            self._processing.restart(self.now_ms)

    def _to_engine(self, samples: Samples, last: bool = False) -> Samples:
        """Wire-rate samples to 16 kHz, processed (rules 2, 5)."""
        resampled = self._resampler.push(samples, last=last)
        if self._processing is None:
            return resampled
        return self._processing.push(resampled, last=last)

    # -- positions ----------------------------------------------------------------------

    @property
    def _samples_end_ms(self) -> float:
        return self._samples_start_ms + len(self._samples) / _PER_MS

    def _clip(self, lo: int, hi: int) -> Clip:
        first_ms, last_ms = self._time_of(lo), self._time_of(hi)
        if self._samples_end_ms < last_ms - 0.5 / _PER_MS:
            self.settle()
        samples = self._samples.copy(self._sample_index(first_ms), self._sample_index(last_ms))
        return Clip(self._data.copy(lo, hi).tobytes(), self.fmt, samples)

    def _keep(self, samples: Samples) -> None:
        if samples.size:
            self._samples.extend(samples)
            self._fresh.append(samples)

    def _byte_span(self, start_ms: float, end_ms: float) -> tuple[int, int]:
        """Byte offsets of [start_ms, end_ms) in the buffer, on whole samples."""
        fmt, step = self.fmt, self.fmt.sample_bytes
        lo = max(0, int((start_ms - self.start_ms) * fmt.bytes_per_ms) // step * step)
        hi = max(lo, int((end_ms - self.start_ms) * fmt.bytes_per_ms) // step * step)
        return lo, min(hi, len(self._data))

    def _time_of(self, offset: int) -> float:
        return self.start_ms + self.fmt.duration_ms(offset)

    def _sample_index(self, at_ms: float) -> int:
        index = round((at_ms - self._samples_start_ms) * _PER_MS)
        return min(max(index, 0), len(self._samples))

    def _drop_before(self, at_ms: float) -> None:
        """Forget the audio before session time `at_ms` in both forms."""
        drop = min(int(round((at_ms - self.start_ms) * self.fmt.bytes_per_ms)), len(self._data))
        self._data.drop(drop)
        self.start_ms = at_ms if len(self._data) else self.now_ms
        count = self._sample_index(at_ms)
        self._samples.drop(count)
        self._samples_start_ms += count / _PER_MS


class _Ring:
    """Values of one dtype added at the back and dropped from the front, in a circular
    array. At steady state (a silent session keeps its newest 30 s) nothing it holds is
    ever moved: an array compacted or regrown when its end was reached copied all of
    it at once, and sessions opened together did so in the same event-loop turn."""

    def __init__(self, dtype: type[np.generic], capacity: int) -> None:
        self._array: np.ndarray = np.empty(max(capacity, 1), dtype)
        self._start = 0  # where the oldest value is
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def extend(self, values: np.ndarray) -> None:
        count = len(values)
        if self._size + count > len(self._array):
            self._grow(2 * (self._size + count))
        capacity = len(self._array)
        at = (self._start + self._size) % capacity
        first = min(count, capacity - at)
        self._array[at : at + first] = values[:first]
        self._array[: count - first] = values[first:]
        self._size += count

    def copy(self, start: int, end: int) -> np.ndarray:
        """Values `start` to `end` (0: the oldest), as an array of their own."""
        count = max(end - start, 0)
        capacity = len(self._array)
        at = (self._start + start) % capacity
        first = min(count, capacity - at)
        values: np.ndarray = (
            self._array[at : at + count].copy()
            if first == count
            else np.concatenate([self._array[at:], self._array[: count - first]])
        )
        return values

    def drop(self, count: int) -> None:
        """Forget the oldest `count` values."""
        count = min(count, self._size)
        self._start = (self._start + count) % len(self._array)
        self._size -= count

    def _grow(self, capacity: int) -> None:
        array = np.empty(capacity, self._array.dtype)
        array[: self._size] = self.copy(0, self._size)
        self._array, self._start = array, 0
