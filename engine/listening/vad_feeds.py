"""Every session's server-VAD audio of one tick (`TICK_S`), handed to the engine in one
call (`VadStage.feed_many`) instead of one call per frame per session.

With 100 microphones streaming 20 ms frames, a call per frame is 5,000 thread hops a
second, each a future, a wake-up of the VAD thread and a wake-up of the loop, and the
VAD thread runs its model on the one or two streams whose frame just came. Batched, it
is 50 calls a second, and each VAD step runs every stream with a chunk ready in one
pass. The price is at most one tick of delay on speech decisions, against the 32 ms
chunks the VAD hears in and the hundreds of ms of silence that end a turn. A feed still
completes (or raises the KeyError or ValueError of a closed stream or a refused piece)
for its own caller, so each session keeps its order and its bounds.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np

__all__ = ["TICK_S", "VadFeeds", "vad_feeds"]

TICK_S = 0.02  # one microphone frame
T = TypeVar("T")


class VadStage(Protocol):
    """The part of the engine's VAD stage a feed calls."""

    def feed_many(self, pieces: Sequence[tuple[str, np.ndarray]]) -> list[Exception | None]: ...


class _Engine(Protocol):
    async def run(self, stage: str, fn: Callable[[VadStage], T]) -> T: ...


class VadFeeds:
    def __init__(self, engine: _Engine) -> None:
        self._engine = engine
        self._pieces: list[tuple[str, np.ndarray]] = []
        self._errors: asyncio.Future[list[Exception | None]] | None = None
        self._calls: set[asyncio.Task[None]] = set()

    async def feed(self, stream_id: str, samples: np.ndarray) -> None:
        """Queue `samples` on VAD stream `stream_id`; return once the stage has them."""
        if self._errors is None:
            self._errors = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(TICK_S, self._send)
        index = len(self._pieces)
        self._pieces.append((stream_id, samples))
        # Shielded: a session that closes while waiting must not cancel the others' feed.
        error = (await asyncio.shield(self._errors))[index]
        if error is not None:
            raise error

    def _send(self) -> None:
        pieces, errors = self._pieces, self._errors
        self._pieces, self._errors = [], None
        assert errors is not None
        call = asyncio.ensure_future(self._call(pieces, errors))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)

    async def _call(
        self, pieces: list[tuple[str, np.ndarray]], errors: asyncio.Future[list[Exception | None]]
    ) -> None:
        try:
            result = await self._engine.run("vad", lambda vad: vad.feed_many(pieces))
        except Exception as exc:  # the engine stopped: every waiting feed gets it
            errors.set_exception(exc)
            errors.exception()  # retrieved here: the feeds may all have been cancelled
            return
        assert isinstance(result, list)
        errors.set_result(result)


_SHARED: weakref.WeakKeyDictionary[_Engine, VadFeeds] = weakref.WeakKeyDictionary()


def vad_feeds(engine: _Engine) -> VadFeeds:
    """The one `VadFeeds` of `engine`, shared by every session's speech source."""
    feeds = _SHARED.get(engine)
    if feeds is None:
        feeds = _SHARED[engine] = VadFeeds(engine)
    return feeds
