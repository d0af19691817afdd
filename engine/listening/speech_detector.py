"""Turn per-chunk speech probabilities into speech start/stop events on one stream clock.

Pure Python and numpy, no MLX: the gateway runs it on the event loop next to the audio
it buffers. Times are milliseconds since the first chunk pushed, counted from chunk
sizes, so they stay exact however the probabilities arrive.

Rules (Silero's own streaming iterator, plus the OpenAI server-VAD fields):
- Speech starts at the first chunk whose probability is >= `threshold`. The reported
  start is that chunk's start minus `prefix_padding_ms`, clamped at 0, so the audio
  kept for the turn includes the breath before the first word.
- While speaking, a chunk below `threshold - 0.15` (the hysteresis Silero uses) opens a
  silence that began at that chunk's start; a chunk at or above `threshold` closes it.
  Chunks in between change nothing.
- Speech stops once the open silence has lasted `silence_duration_ms`. `audio_end_ms` is
  where the silence began (the end of the last speech chunk); `detected_ms` is where the
  decision was taken, i.e. `audio_end_ms` plus at least `silence_duration_ms`.
- With `confirm_after_ms` set, a speech that has been heard for that long (chunks at or
  above `threshold`, counted since its start) reports once that it is confirmed: the
  gateway treats speech over the assistant as an interruption only then.
- `end_silence()` ends the speech at once if a silence is open (semantic turn ends).
- With `pause_after_ms` set (below `silence_duration_ms`), an open silence that lasts that
  long first reports a pause with the `audio_end_ms` the stop would have, so work on the
  turn can start while the silence runs on; speech coming back before the stop reports
  that the pause is over.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "SpeechDetector",
    "SpeechConfirmed",
    "SpeechEvent",
    "SpeechPaused",
    "SpeechResumed",
    "SpeechStarted",
    "SpeechStopped",
]

HYSTERESIS = 0.15
MIN_NEG_THRESHOLD = 0.01


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechStarted:
    audio_start_ms: int
    detected_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechStopped:
    audio_end_ms: int
    detected_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechPaused:
    audio_end_ms: int
    detected_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechResumed:
    detected_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechConfirmed:
    audio_start_ms: int
    detected_ms: int


SpeechEvent = SpeechStarted | SpeechStopped | SpeechPaused | SpeechResumed | SpeechConfirmed


class SpeechDetector:
    def __init__(
        self,
        threshold: float = 0.5,
        prefix_padding_ms: int = 300,
        silence_duration_ms: int = 500,
        sample_rate: int = 16000,
        chunk: int = 512,
        pause_after_ms: int | None = None,
        confirm_after_ms: int | None = None,
    ) -> None:
        real = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
        if not real or not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be within [0, 1], got {threshold!r}")
        self.threshold = float(threshold)
        self.neg_threshold = max(self.threshold - HYSTERESIS, MIN_NEG_THRESHOLD)
        self.prefix_padding_ms = _whole("prefix_padding_ms", prefix_padding_ms, minimum=0)
        self.silence_duration_ms = _whole("silence_duration_ms", silence_duration_ms, minimum=0)
        self.sample_rate = _whole("sample_rate", sample_rate, minimum=1)
        self.chunk = _whole("chunk", chunk, minimum=1)
        if pause_after_ms is not None:
            pause_after_ms = _whole("pause_after_ms", pause_after_ms, minimum=0)
        # A pause as long as the stop's silence would only ever come with the stop.
        useful = pause_after_ms is not None and pause_after_ms < self.silence_duration_ms
        self.pause_after_ms = pause_after_ms if useful else None
        self.confirm_after_ms = (
            None
            if confirm_after_ms is None
            else _whole("confirm_after_ms", confirm_after_ms, minimum=0)
        )
        self._chunks = 0  # chunks seen: the stream clock
        self._start_ms = 0  # the reported start of the speech under way
        self._voiced = 0  # chunks at or above threshold in the speech under way
        self._onset = 0  # chunk index of the speech under way's first voiced chunk
        self._speeches = 0
        self._confirmed = False
        self._speaking = False
        self._silence_start: int | None = None  # chunk index where the open silence began
        self._paused = False  # a pause was reported for the open silence

    @property
    def speaking(self) -> bool:
        return self._speaking

    @property
    def position_ms(self) -> int:
        """The stream clock: the end of the last chunk pushed."""
        return self._ms(self._chunks)

    def _ms(self, chunks: int) -> int:
        return chunks * self.chunk * 1000 // self.sample_rate

    def push(self, probabilities: Iterable[float] | np.ndarray | float) -> list[SpeechEvent]:
        """Feed the probabilities of the next chunks, in order; return the events they cause."""
        probs = np.atleast_1d(np.asarray(probabilities, dtype=np.float64))
        if probs.ndim != 1:
            raise ValueError(f"probabilities must be one value per chunk, got shape {probs.shape}")
        if probs.size and not (np.isfinite(probs).all() and 0 <= probs.min() <= probs.max() <= 1):
            raise ValueError("probabilities must be finite and within [0, 1]")
        events: list[SpeechEvent] = []
        for p in probs.tolist():
            event = self._push_one(p)
            if event is not None:
                events.append(event)
            confirmed = self._check_confirmed()
            if confirmed is not None:
                events.append(confirmed)
        return events

    def _check_confirmed(self) -> SpeechConfirmed | None:
        if self.confirm_after_ms is None or not self._speaking or self._confirmed:
            return None
        if self._ms(self._voiced) < self.confirm_after_ms:
            return None
        self._confirmed = True
        return SpeechConfirmed(audio_start_ms=self._start_ms, detected_ms=self.position_ms)

    @property
    def voiced_ms(self) -> int:
        """How long the speech under way has been heard (its chunks at or above threshold)."""
        return self._ms(self._voiced) if self._speaking else 0

    @property
    def heard_ms(self) -> int:
        """How long ago the speech under way began (its first chunk at or above threshold),
        voiced or not since: consonants such as the "x" of "excuse" dip below it."""
        return self._ms(self._chunks - self._onset) if self._speaking else 0

    @property
    def speech_number(self) -> int:
        """Counts the speeches started so far: tells a late answer about one from the next."""
        return self._speeches

    @property
    def confirmed(self) -> bool:
        """Whether the speech under way has been confirmed (heard long enough, or meant)."""
        return self._speaking and self._confirmed

    def confirm(self) -> SpeechConfirmed | None:
        """Confirm the speech under way now (its words showed it is meant), once."""
        if not self._speaking or self._confirmed:
            return None
        self._confirmed = True
        return SpeechConfirmed(audio_start_ms=self._start_ms, detected_ms=self.position_ms)

    def reopen(self) -> None:
        """The speech under way is not confirmed after all: count its length again from
        here, and let its words or its length confirm it once more."""
        if self._speaking:
            self._confirmed = False
            self._voiced = 0

    @property
    def silent_since_ms(self) -> int | None:
        """Where the open silence in speech began (None: speaking, or no speech)."""
        return None if self._silence_start is None else self._ms(self._silence_start)

    def end_silence(self) -> SpeechStopped | None:
        """End the speech now, at the start of its open silence (None if none is open)."""
        if not self._speaking or self._silence_start is None:
            return None
        end = self._ms(self._silence_start)
        self._speaking = False
        self._paused = False
        self._silence_start = None
        return SpeechStopped(audio_end_ms=end, detected_ms=self.position_ms)

    def _push_one(self, p: float) -> SpeechEvent | None:
        index = self._chunks
        self._chunks += 1
        if not self._speaking:
            if p < self.threshold:
                return None
            self._speaking = True
            self._silence_start = None
            self._voiced = 1
            self._onset = index
            self._speeches += 1
            self._confirmed = False
            self._start_ms = max(0, self._ms(index) - self.prefix_padding_ms)
            return SpeechStarted(audio_start_ms=self._start_ms, detected_ms=self.position_ms)
        if p >= self.threshold:
            self._voiced += 1
            self._silence_start = None
            if self._paused:
                self._paused = False
                return SpeechResumed(detected_ms=self.position_ms)
        elif p < self.neg_threshold and self._silence_start is None:
            self._silence_start = index
        if self._silence_start is None:
            return None
        end = self._ms(self._silence_start)
        silence_ms = self.position_ms - end
        if silence_ms >= self.silence_duration_ms:
            self._speaking = False
            self._paused = False
            self._silence_start = None
            return SpeechStopped(audio_end_ms=end, detected_ms=self.position_ms)
        pause = self.pause_after_ms
        if pause is not None and silence_ms >= pause and not self._paused:
            self._paused = True
            return SpeechPaused(audio_end_ms=end, detected_ms=self.position_ms)
        return None

    def __repr__(self) -> str:
        return (
            f"SpeechDetector(threshold={self.threshold}, prefix_padding_ms="
            f"{self.prefix_padding_ms}, silence_duration_ms={self.silence_duration_ms}, "
            f"position_ms={self.position_ms}, speaking={self._speaking})"
        )


def _whole(name: str, value: object, *, minimum: int) -> int:
    """`value` as an int; whole floats (300.0 from JSON) are accepted, 2.5 is not."""
    number = int(value) if isinstance(value, float) and value.is_integer() else value
    if isinstance(number, bool) or not isinstance(number, int) or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number
