"""A WebRTC call's audio: the assistant's voice on the outgoing RTP track, paced in real
time, and the caller's decoded frames taken off the incoming one.

Rules of this module:

1. The outgoing track plays at the pace of a clock: aiortc asks for a 20 ms frame as
   soon as it has sent the last one, so `recv` waits until the frame is due. What it
   returned is what was sent, so the position it keeps per item is what the caller has
   been sent, and a barge-in truncates the item there (`cut`).
2. Between answers the track plays silence: the RTP stream never stalls, and the
   browser's jitter buffer and echo canceller keep their timing.
3. `output_audio_buffer.started` is reported when a response's first sample goes out;
   `.stopped` once its response is done and its last sample went out; a cut reports
   nothing here: the call reports `.cleared`.
4. At most `MAX_QUEUED_S` seconds wait to be played. Answers come faster than real time
   and wait here whole; anything beyond the bound is dropped and logged, never held.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame
from av.frame import Frame
from numpy.typing import NDArray

from gateway.protocol.audio import MEDIA_PCM

__all__ = ["FRAME_SAMPLES", "Cut", "PacedAudioTrack", "mono_pcm"]

logger = logging.getLogger(__name__)

RATE = MEDIA_PCM.rate
FRAME_SAMPLES = RATE // 50  # 20 ms, Opus's usual frame
MAX_QUEUED_S = 300
_TIME_BASE = fractions.Fraction(1, RATE)


@dataclass
class _Segment:
    response_id: str
    item_id: str
    pcm: NDArray[np.int16]


@dataclass(frozen=True)
class Cut:
    """Audio of `item_id` (of `response_id`) that stopped playing after `played_ms`."""

    response_id: str
    item_id: str
    played_ms: int


# (event type, response id): what the track reports (rule 3).
Report = Callable[[str, str], None]


class PacedAudioTrack(MediaStreamTrack):
    """The assistant's audio, 48 kHz mono PCM16, one 20 ms frame per `recv` (rule 1)."""

    kind = "audio"

    def __init__(self, report: Report, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._report = report
        self._clock = clock
        self._queue: deque[_Segment] = deque()
        self._queued = 0  # samples in the queue
        self._start: float | None = None  # the clock time of the first frame
        self._sent = 0  # samples returned so far, silence included
        self._playing: str | None = None  # the response whose audio is going out
        self._item: str | None = None  # the item whose audio went out last
        self._item_samples = 0  # samples of `_item` sent
        self._done: set[str] = set()  # responses done, their audio still going out

    @property
    def queued_s(self) -> float:
        """Audio waiting to be played, in seconds (rule 4)."""
        return self._queued / RATE

    @property
    def playing(self) -> bool:
        return self._playing is not None or bool(self._queue)

    def push(self, response_id: str, item_id: str, pcm: bytes) -> None:
        samples = np.frombuffer(pcm, dtype="<i2")
        room = MAX_QUEUED_S * RATE - self._queued
        if len(samples) > room:
            logger.warning("call audio: %d samples over the bound dropped", len(samples) - room)
            samples = samples[: max(room, 0)]
        if len(samples):
            self._queue.append(_Segment(response_id, item_id, samples))
            self._queued += len(samples)

    def done(self, response_id: str) -> None:
        """The response finished: no more of its audio comes (rule 3)."""
        if response_id == self._playing or any(s.response_id == response_id for s in self._queue):
            self._done.add(response_id)

    def cut(self) -> list[Cut]:
        """Stop everything waiting to play; what each cut item had played (rule 1)."""
        cuts: list[Cut] = []
        if self._playing is not None and self._item is not None:
            cuts.append(Cut(self._playing, self._item, self._played_ms(self._item_samples)))
        for segment in self._queue:
            if all(c.item_id != segment.item_id for c in cuts):
                cuts.append(Cut(segment.response_id, segment.item_id, 0))
        self._queue.clear()
        self._queued = 0
        self._playing = None
        self._item = None
        self._item_samples = 0
        self._done.clear()
        return cuts

    async def recv(self) -> Frame:
        if self.readyState != "live":
            raise MediaStreamError
        now = self._clock()
        if self._start is None:
            self._start = now
        else:
            due = self._start + self._sent / RATE
            if due > now:
                await asyncio.sleep(due - now)
        pcm = self._take(FRAME_SAMPLES)
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        frame.pts = self._sent
        frame.time_base = _TIME_BASE
        self._sent += FRAME_SAMPLES
        return frame

    def _take(self, count: int) -> NDArray[np.int16]:
        out = np.zeros(count, np.int16)  # silence where nothing plays (rule 2)
        filled = 0
        while filled < count and self._queue:
            segment = self._queue[0]
            if segment.response_id != self._playing:
                if self._playing is not None:
                    self._stopped(self._playing)
                self._playing = segment.response_id
                self._report("output_audio_buffer.started", segment.response_id)
            if segment.item_id != self._item:
                self._item, self._item_samples = segment.item_id, 0
            n = min(count - filled, len(segment.pcm))
            out[filled : filled + n] = segment.pcm[:n]
            segment.pcm = segment.pcm[n:]
            filled += n
            self._queued -= n
            self._item_samples += n
            if not len(segment.pcm):
                self._queue.popleft()
        playing = self._playing
        if playing in self._done and all(s.response_id != playing for s in self._queue):
            self._stopped(playing)
        return out

    def _stopped(self, response_id: str) -> None:
        self._done.discard(response_id)
        self._playing = None
        self._report("output_audio_buffer.stopped", response_id)

    @staticmethod
    def _played_ms(samples: int) -> int:
        return samples * 1000 // RATE


def mono_pcm(frame: AudioFrame) -> bytes:
    """A decoded frame (packed PCM16, any layout) as mono PCM16 bytes: its first channel,
    the one a browser's microphone fills (rule of the input path: no mixing, no rate
    change here; the session's input buffer resamples once)."""
    if frame.format.name != "s16" or frame.sample_rate != RATE:
        raise ValueError(
            f"expected PCM16 at {RATE} Hz, got {frame.format.name} at {frame.sample_rate}"
        )
    channels = frame.layout.nb_channels
    samples = frame.to_ndarray().reshape(-1, channels)[:, 0]
    return samples.astype("<i2").tobytes()
