"""One session's appended audio on its way to the engine's VAD stage, within bounds.

The VAD hears every appended sample, whatever the size of an append: the engine's VAD
stage holds a bounded amount of unheard audio per stream, so the feeder hands it audio
in pieces and waits for the probabilities of earlier pieces before it sends more. A
client replaying a recorded file in one append is heard as if it had streamed it.

Audio waiting for the feeder is bounded too: past `MAX_QUEUED_SAMPLES`, `room()` makes
the connection stop reading the client's frames until the VAD has caught up, so a client
that sends audio faster than it can be heard is slowed down by TCP, never given up on.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol, TypeVar

import numpy as np

from engine.listening.vad_feeds import VadStage, vad_feeds
from engine.runtime.stage import StageOutput

__all__ = [
    "FEED_PIECE_SAMPLES",
    "MAX_QUEUED_SAMPLES",
    "MAX_UNHEARD_SAMPLES",
    "FeedProgress",
    "VadEngine",
    "VadFeeder",
]

logger = logging.getLogger(__name__)

# 16 kHz samples handed to the VAD stage at once, and the most left unheard there: well
# under the 30 s the stage holds per stream, so a feed is never refused.
FEED_PIECE_SAMPLES = 4 * 16_000
MAX_UNHEARD_SAMPLES = 12 * 16_000
# Appended audio waiting to be fed, beyond which the client's frames wait unread: about
# 4 MB, heard by the VAD in a fraction of a second (bench/vad.py).
MAX_QUEUED_SAMPLES = 60 * 16_000


T = TypeVar("T")


class VadEngine(Protocol):
    """The part of `engine.runtime.core.AsyncEngine` speech detection uses."""

    def stream(self, stage: str, request_id: str, inputs: object) -> AsyncIterator[StageOutput]:
        """Open a request on `stage`; its outputs until the finished one."""

    async def run(self, stage: str, fn: Callable[[VadStage], T]) -> T:
        """Run `fn(stage)` on the engine thread (server VAD calls the VAD stage)."""

    def abort(self, stage: str, request_id: str) -> None:
        """Stop a request; its stream ends."""


class FeedProgress:
    """How far the VAD stage got through one stream's audio: samples handed over (`fed`)
    and heard."""

    def __init__(self) -> None:
        self.fed = 0
        self.heard = 0
        self.closed = False
        self._changed: Callable[[], None] | None = None

    def hear(self, samples: int) -> None:
        self.heard += samples
        self._notify()

    def close(self) -> None:
        self.closed = True
        self._notify()

    def has_room(self, samples: int) -> bool:
        """Whether `samples` more keep the unheard audio within its bound."""
        return self.fed - self.heard + samples <= MAX_UNHEARD_SAMPLES

    def on_change(self, changed: Callable[[], None]) -> None:
        """Call `changed` once, at the next `hear` or `close`."""
        self._changed = changed

    def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed()


class VadFeeder:
    """Feeds the appended audio, in order, to the VAD stream open now (`stream_id`).

    Audio goes to the tick's engine call as it comes, in pieces of at most
    `FEED_PIECE_SAMPLES`, while the stream's unheard audio has room; the rest waits here
    until the VAD's probabilities say it heard more. No task and no future per frame: a
    frame on a stream with room costs a list append."""

    def __init__(self, engine: VadEngine) -> None:
        self._feeds = vad_feeds(engine)
        self.stream_id: str | None = None  # the stream appended audio goes to; None: none
        self.progress = FeedProgress()  # that stream's
        self._waiting: collections.deque[tuple[str, np.ndarray, int]] = collections.deque()
        self._queued = 0  # samples of the appends not yet handed over whole
        self._caught_up = asyncio.Event()
        self._caught_up.set()
        self._closed = False

    def open(self, stream_id: str) -> FeedProgress:
        """Feed `stream_id` from now on; returns its progress, for its reader to report
        what the VAD heard."""
        self.stream_id = stream_id
        self.progress = FeedProgress()
        self._feed()  # audio of the stream before, if any waits, is dropped
        return self.progress

    def put(self, samples: np.ndarray) -> None:
        """Queue `samples` for the open stream."""
        assert self.stream_id is not None
        if self._closed:
            return
        self._waiting.append((self.stream_id, samples, samples.size))
        self._queued += samples.size
        if self._queued > MAX_QUEUED_SAMPLES:
            self._caught_up.clear()
        self._feed()

    async def room(self) -> None:
        """Wait until the queued audio is back within `MAX_QUEUED_SAMPLES`."""
        await self._caught_up.wait()

    def close(self) -> None:
        self._closed = True
        self._waiting.clear()
        self._queued = 0
        self._caught_up.set()  # nothing will be fed any more: nobody may wait for it

    def _feed(self) -> None:
        """Hand over what waits, in order, while the open stream has room."""
        progress = self.progress
        while self._waiting:
            stream_id, samples, size = self._waiting[0]
            if stream_id != self.stream_id or progress.closed:
                self._handed_over(size)  # audio for a stream closed since
                continue
            piece = samples[:FEED_PIECE_SAMPLES]
            if not progress.has_room(piece.size):
                progress.on_change(self._feed)
                return
            if piece.size < samples.size:
                self._waiting[0] = (stream_id, samples[piece.size :], size)
            else:
                self._handed_over(size)
            progress.fed += piece.size
            self._feeds.add(stream_id, piece, functools.partial(_fed, stream_id))

    def _handed_over(self, size: int) -> None:
        self._waiting.popleft()
        self._queued -= size
        if self._queued <= MAX_QUEUED_SAMPLES:
            self._caught_up.set()


def _fed(stream_id: str, error: Exception | None) -> None:
    # The stream closed under us (KeyError); a refusal (ValueError) is a bug in the
    # bound above, and is logged as one.
    if error is not None:
        log = logger.debug if isinstance(error, KeyError) else logger.error
        log("VAD feed for %s dropped: %s", stream_id, error)
