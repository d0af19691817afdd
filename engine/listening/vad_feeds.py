"""Every session's server-VAD audio of one tick (`TICK_S`), handed to the engine in one
call (`VadStage.feed_many`) instead of one call per frame per session.

With 100 microphones streaming 20 ms frames, a call per frame is 5,000 thread hops a
second, each a future, a wake-up of the VAD thread and a wake-up of the loop, and the
VAD thread runs its model on the one or two streams whose frame just came. Batched, it
is 50 calls a second, and each VAD step runs every stream with a chunk ready in one
pass. The price is at most one tick of delay on speech decisions, against the 32 ms
chunks the VAD hears in and the hundreds of ms of silence that end a turn.

A piece is added with a callback, not awaited: a frame then costs the loop a list
append, and the tick's one engine call answers every piece (None, or the KeyError or
ValueError of a closed stream or a refused piece) in the order they came, so each
session keeps its order and its bounds.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np

__all__ = ["TICK_S", "Fed", "VadFeeds", "vad_feeds"]

logger = logging.getLogger(__name__)

TICK_S = 0.02  # one microphone frame
T = TypeVar("T")
# What a piece's sender is told once the stage has it: None, or why it was refused.
Fed = Callable[[Exception | None], None]


class VadStage(Protocol):
    """The part of the engine's VAD stage a feed calls."""

    def feed_many(self, pieces: Sequence[tuple[str, np.ndarray]]) -> list[Exception | None]: ...


class _Engine(Protocol):
    async def run(self, stage: str, fn: Callable[[VadStage], T]) -> T: ...


class VadFeeds:
    def __init__(self, engine: _Engine) -> None:
        self._engine = engine
        self._pieces: list[tuple[str, np.ndarray]] = []
        self._senders: list[Fed] = []
        self._calls: set[asyncio.Task[None]] = set()

    def add(self, stream_id: str, samples: np.ndarray, fed: Fed) -> None:
        """Queue `samples` on VAD stream `stream_id` for this tick's call; `fed` is
        called once the stage has them (or refused them)."""
        if not self._pieces:
            asyncio.get_running_loop().call_later(TICK_S, self._send)
        self._pieces.append((stream_id, samples))
        self._senders.append(fed)

    def _send(self) -> None:
        pieces, senders = self._pieces, self._senders
        self._pieces, self._senders = [], []
        call = asyncio.ensure_future(self._call(pieces, senders))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)

    async def _call(self, pieces: list[tuple[str, np.ndarray]], senders: list[Fed]) -> None:
        try:
            errors: list[Exception | None] = await self._engine.run(
                "vad", lambda vad: vad.feed_many(pieces)
            )
        except Exception as exc:  # the engine stopped: every piece's sender is told
            errors = [exc] * len(pieces)
        for fed, error in zip(senders, errors, strict=True):
            try:
                fed(error)
            except Exception:  # one sender's bug must not keep the others uninformed
                logger.exception("a VAD feed's callback failed")


_SHARED: weakref.WeakKeyDictionary[_Engine, VadFeeds] = weakref.WeakKeyDictionary()


def vad_feeds(engine: _Engine) -> VadFeeds:
    """The one `VadFeeds` of `engine`, shared by every session's speech source."""
    feeds = _SHARED.get(engine)
    if feeds is None:
        feeds = _SHARED[engine] = VadFeeds(engine)
    return feeds
