"""The playback runway of one spoken response: how much of its audio the client still
has to play, if it plays from the first delta on.

runway = audio sent - wall time since the first delta

A stall is the runway falling below zero before the next audio goes out while the
response is still producing: the client ran dry and heard a gap. It then plays the new
audio as it arrives, so the gap moves the playback start later by its length. Audio
that never comes (the response ended) is no stall: the answer is simply over.

Times are seconds on a clock the caller reads (`now`): the accounting reads none.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AudioSent", "Runway"]


@dataclass(frozen=True)
class AudioSent:
    """What one piece of audio going out found: the runway just before it (None for a
    response's first audio), and the gap the client heard if it had run dry."""

    runway_s: float | None
    stall_s: float = 0.0


class Runway:
    def __init__(self) -> None:
        self._start: float | None = None  # when playback of the first delta began
        self._sent_s = 0.0

    @property
    def started(self) -> bool:
        return self._start is not None

    def left(self, now: float) -> float | None:
        """Audio the client has yet to play at `now`; None before the first delta."""
        if self._start is None:
            return None
        return self._sent_s - (now - self._start)

    def send(self, now: float, seconds: float) -> AudioSent:
        """`seconds` of audio go out at `now`."""
        before = self.left(now)
        if self._start is None:
            self._start = now
        stall = max(0.0, -before) if before is not None else 0.0
        self._start += stall  # playback resumes with this audio
        self._sent_s += seconds
        return AudioSent(before, stall)
