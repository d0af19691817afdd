"""The newest audio of one VAD stream, kept for the turn-end model and the words checks
that look back at the speech under way."""

from __future__ import annotations

import numpy as np

from gateway.vad_feeder import MAX_UNHEARD_SAMPLES

__all__ = ["KEEP_FOR_SCORING_SAMPLES", "SAMPLES_PER_MS", "RecentAudio"]

# Audio kept for the turn-end model: its 8 s window plus what the VAD may not yet have
# heard.
KEEP_FOR_SCORING_SAMPLES = 8 * 16_000 + MAX_UNHEARD_SAMPLES
SAMPLES_PER_MS = 16


class RecentAudio:
    """The newest samples of one VAD stream, addressable by stream time. Appends fill a
    buffer twice the size kept; when it is full the newest half moves to its front."""

    def __init__(self) -> None:
        self._buffer = np.zeros(2 * KEEP_FOR_SCORING_SAMPLES, np.float32)
        self._used = 0
        self._offset = 0  # stream sample index of self._buffer[0]

    def append(self, samples: np.ndarray) -> None:
        samples = samples[-KEEP_FOR_SCORING_SAMPLES:]
        if self._used + len(samples) > len(self._buffer):
            keep = KEEP_FOR_SCORING_SAMPLES - len(samples)
            drop = self._used - keep
            self._buffer[:keep] = self._buffer[drop : self._used]
            self._used, self._offset = keep, self._offset + drop
        self._buffer[self._used : self._used + len(samples)] = samples
        self._used += len(samples)

    def clip(self, start_ms: int, end_ms: int) -> np.ndarray:
        start = min(max(start_ms * SAMPLES_PER_MS - self._offset, 0), self._used)
        end = min(max(end_ms * SAMPLES_PER_MS - self._offset, start), self._used)
        clip: np.ndarray = self._buffer[start:end].copy()
        return clip
