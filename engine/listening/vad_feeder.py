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
    """How far the VAD stage got through one stream's audio: samples fed and heard."""

    def __init__(self) -> None:
        self.fed = 0
        self.heard = 0
        self.closed = False
        self._changed = asyncio.Event()

    def hear(self, samples: int) -> None:
        self.heard += samples
        self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def room_for(self, samples: int) -> None:
        """Wait until `samples` more keep the unheard audio within its bound (or the
        stream is closed: the caller then drops the audio of a stream nobody reads)."""
        while not self.closed and self.fed - self.heard + samples > MAX_UNHEARD_SAMPLES:
            self._changed.clear()
            await self._changed.wait()


class VadFeeder:
    """Feeds the appended audio, in order, to the VAD stream open now (`stream_id`)."""

    def __init__(self, engine: VadEngine) -> None:
        self._engine = engine
        self.stream_id: str | None = None  # the stream appended audio goes to; None: none
        self.progress = FeedProgress()  # that stream's
        self._feeds: asyncio.Queue[tuple[str, np.ndarray]] = asyncio.Queue()
        self._queued = 0  # samples in `_feeds` and in the append being fed
        self._caught_up = asyncio.Event()
        self._caught_up.set()
        self._task = asyncio.create_task(self._feed_loop(), name="vad-feed")

    def open(self, stream_id: str) -> FeedProgress:
        """Feed `stream_id` from now on; returns its progress, for its reader to report
        what the VAD heard."""
        self.stream_id = stream_id
        self.progress = FeedProgress()
        return self.progress

    def put(self, samples: np.ndarray) -> None:
        """Queue `samples` for the open stream."""
        assert self.stream_id is not None
        self._feeds.put_nowait((self.stream_id, samples))
        self._queued += samples.size
        if self._queued > MAX_QUEUED_SAMPLES:
            self._caught_up.clear()

    async def room(self) -> None:
        """Wait until the queued audio is back within `MAX_QUEUED_SAMPLES`."""
        await self._caught_up.wait()

    def close(self) -> None:
        self._task.cancel()
        self._caught_up.set()  # nothing will be fed any more: nobody may wait for it

    async def _feed_loop(self) -> None:
        while True:
            stream_id, samples = await self._feeds.get()
            for start in range(0, len(samples), FEED_PIECE_SAMPLES):
                if not await self._feed_piece(
                    stream_id, samples[start : start + FEED_PIECE_SAMPLES]
                ):
                    break
            self._queued -= samples.size
            if self._queued <= MAX_QUEUED_SAMPLES:
                self._caught_up.set()

    async def _feed_piece(self, stream_id: str, piece: np.ndarray) -> bool:
        """Hand one piece to the VAD stage once it has room; False if the stream is gone."""
        progress = self.progress
        if stream_id != self.stream_id:
            return False  # audio for a stream closed since
        await progress.room_for(len(piece))
        if progress.closed:
            return False
        try:
            await vad_feeds(self._engine).feed(stream_id, piece)  # one engine call a tick
        except (KeyError, ValueError) as exc:
            # The stream closed under us (KeyError); a refusal (ValueError) is a bug in
            # the bound above, and is logged as one.
            log = logger.debug if isinstance(exc, KeyError) else logger.error
            log("VAD feed for %s dropped: %s", stream_id, exc)
            return False
        progress.fed += len(piece)
        return True
