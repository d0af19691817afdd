"""The far end of a session: the assistant audio its client plays, on the session clock.

The echo canceller (`gateway.session.input_processing`) subtracts what the microphone picked up
of this audio, so it needs each sample where the client plays it. Rules:

1. The session clock is the input audio appended so far. A delta that goes out when
   the clock reads `t` is played from `t` on, or right after the audio before it if that
   is still playing: a client plays at real-time pace what arrived ahead of time, and a
   gap (the answer came late) is silence. What remains (network, device buffers, the
   room) is unknown and drifts; the canceller estimates it.
2. `conversation.item.truncate` says how much of an item the client played: the audio
   after that point, and anything queued behind it, is never played, so it is dropped.
   A canceller fed audio that never played would subtract echo that is not there.
3. Audio is kept at 16 kHz from the oldest sample the canceller may still read; the
   canceller lets go of what it has read (`forget_before`). At most `KEPT_S` seconds are
   kept: a client that sends no input never moves the clock, and its answers would
   otherwise pile up for the whole session.
4. The words each piece of audio speaks are kept beside it, for the last `_SPOKEN_KEPT`
   pieces: `said_between` tells what the client was playing over a span of the clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from gateway.protocol.audio import ENGINE_RATE, Samples, StreamResampler

__all__ = ["KEPT_S", "FarEnd"]

KEPT_S = 60
_PER_MS = ENGINE_RATE / 1000
# Items whose play start is remembered for truncation; clients truncate the newest.
_ITEMS_KEPT = 8
_SPOKEN_KEPT = 64  # rule 4: pieces of a few hundred ms to a few s each


class _Spoken(NamedTuple):
    start: int  # clock sample indices
    end: int
    text: str


class FarEnd:
    """Played audio at 16 kHz, indexed by sample on the session clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock  # the session clock, in ms
        self._audio: Samples = np.zeros(0, np.float32)
        self._base = 0  # the clock sample index of self._audio[0]
        self._resampler: StreamResampler | None = None
        self._item_starts: OrderedDict[str, int] = OrderedDict()
        self._item_id: str | None = None  # the item the resampler's audio belongs to
        # The clock sample index where the last audio sent stops playing; None if none was.
        self.played_until: int | None = None
        # A spoken response started: audio will play soon (the canceller warms up for it).
        self.expected = False
        self._spoken: deque[_Spoken] = deque(maxlen=_SPOKEN_KEPT)

    @property
    def end(self) -> int:
        """The clock sample index after the audio still kept."""
        return self._base + len(self._audio)

    def play(self, item_id: str, samples: Samples, rate: int, text: str = "") -> None:
        """`samples` at `rate`, speaking `text`, went out to the client as part of
        `item_id` (rule 1)."""
        if self._resampler is None or self._resampler.in_rate != rate or item_id != self._item_id:
            self.flush()
            self._resampler = StreamResampler(rate, ENGINE_RATE)
            self._item_id = item_id
        resampled = self._resampler.push(samples)
        start = max(self.end, self._now())  # where this audio plays from
        if item_id not in self._item_starts:
            self._item_starts[item_id] = start
            while len(self._item_starts) > _ITEMS_KEPT:
                self._item_starts.popitem(last=False)
        self._append(resampled)
        if text:
            self._spoken.append(_Spoken(start, max(self.end, start), text))

    def said_between(self, start: int, end: int) -> str:
        """The words of the audio playing between clock sample indices `start` and `end`."""
        return " ".join(s.text for s in self._spoken if s.start < end and s.end > start)

    def flush(self) -> None:
        """The audio of the current item is complete: its resampler's tail plays too."""
        if self._resampler is not None:
            self._append(self._resampler.push(np.zeros(0, np.float32), last=True))
        self._resampler = None
        self._item_id = None

    def truncate(self, item_id: str, audio_end_ms: float) -> None:
        """The client played `item_id` up to `audio_end_ms` and nothing after (rule 2)."""
        start = self._item_starts.get(item_id)
        if start is None:
            return
        cut = start + round(audio_end_ms * _PER_MS)
        if cut < self.end:
            self._spoken = deque((s for s in self._spoken if s.start < cut), _SPOKEN_KEPT)
            self._audio = self._audio[: max(cut - self._base, 0)]
            self._resampler = None
            self._item_id = None
            self.played_until = min(self.played_until or cut, cut)

    def read(self, start: int, count: int) -> Samples:
        """`count` samples from clock sample index `start`; silence where none plays."""
        out = np.zeros(count, np.float32)
        lo, hi = max(start, self._base), min(start + count, self.end)
        if hi > lo:
            out[lo - start : hi - start] = self._audio[lo - self._base : hi - self._base]
        return out

    def forget_before(self, index: int) -> None:
        """The canceller has read everything before clock sample index `index` (rule 3)."""
        drop = min(max(index - self._base, 0), len(self._audio))
        if drop:
            self._audio = self._audio[drop:]
            self._base += drop
        if not len(self._audio):
            self._base = max(self._base, index)

    def _now(self) -> int:
        return round(self._clock() * _PER_MS)

    def _append(self, samples: Samples) -> None:
        if not samples.size:
            return
        gap = self._now() - self.end
        if not len(self._audio):
            # Nothing is playing: this audio starts now (or where the last ended).
            self._base = max(self.end, self._now())
            self._audio = samples.copy()
        else:
            if gap > 0:
                samples = np.concatenate([np.zeros(gap, np.float32), samples])
            self._audio = np.concatenate([self._audio, samples])
        self.played_until = self.end
        self.forget_before(self.end - KEPT_S * ENGINE_RATE)  # rule 3
