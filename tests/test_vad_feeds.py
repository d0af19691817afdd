"""Server-VAD audio of every session in one engine call per event-loop tick: the batch,
per-piece errors for their own callers, and a closing session that leaves the others'
feed alone. `VadStage.feed_many` checks each piece as `feed` does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np
import pytest

from engine.listening.vad_feeds import VadFeeds
from engine.stages.vad import VadStage

T = TypeVar("T")


class RecordingEngine:
    """Runs `VadStage.feed_many` of a real stage inline; records each call's pieces."""

    def __init__(self, stage: VadStage) -> None:
        self.stage = stage
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.called = asyncio.Event()  # a call reached the engine

    async def run(self, stage: str, fn: Callable[[Any], T]) -> T:
        assert stage == "vad"
        self.called.set()
        await self.release.wait()
        return fn(self)

    def feed_many(self, pieces: list[tuple[str, np.ndarray]]) -> list[Exception | None]:
        self.calls.append([stream for stream, _ in pieces])
        return self.stage.feed_many(pieces)


def stage() -> VadStage:
    # feed_many only buffers: a stand-in with the model's shape, never run.
    vad = SimpleNamespace(chunk_ms=32, sample_rate=16_000, chunk_size=512)
    vad.initial_state = lambda: None
    return VadStage(vad, max_pending_ms=1000)  # type: ignore[arg-type]


def frame(ms: int = 20) -> np.ndarray:
    return np.zeros(16 * ms, np.float32)


async def test_one_tick_of_feeds_is_one_engine_call() -> None:
    vad = stage()
    for stream in ("a", "b", "c"):
        vad.add(stream, None)
    engine = RecordingEngine(vad)
    feeds = VadFeeds(engine)
    await asyncio.gather(*(feeds.feed(stream, frame()) for stream in ("a", "b", "c")))
    await feeds.feed("a", frame())
    assert engine.calls == [["a", "b", "c"], ["a"]]


async def test_a_refused_piece_raises_for_its_caller_only() -> None:
    vad = stage()
    vad.add("open", None)
    feeds = VadFeeds(RecordingEngine(vad))
    results = await asyncio.gather(
        feeds.feed("open", frame()),
        feeds.feed("closed", frame()),
        feeds.feed("open", frame(2000)),  # more than the stage holds unheard
        return_exceptions=True,
    )
    assert results[0] is None
    assert isinstance(results[1], KeyError) and isinstance(results[2], ValueError)


async def test_a_cancelled_feed_leaves_the_rest_of_its_batch_alone() -> None:
    vad = stage()
    vad.add("a", None)
    vad.add("b", None)
    engine = RecordingEngine(vad)
    engine.release.clear()
    feeds = VadFeeds(engine)
    leaving = asyncio.create_task(feeds.feed("a", frame()))
    staying = asyncio.create_task(feeds.feed("b", frame()))
    await engine.called.wait()
    leaving.cancel()
    engine.release.set()
    await staying
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert engine.calls == [["a", "b"]]
