"""Server-VAD audio of every session in one engine call per event-loop tick: the batch,
per-piece answers for their own senders, and a sender whose callback fails that leaves
the others answered. `VadStage.feed_many` checks each piece as `feed` does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np

from engine.listening.vad_feeds import VadFeeds
from engine.stages.vad import VadStage

T = TypeVar("T")


class RecordingEngine:
    """Runs `VadStage.feed_many` of a real stage inline; records each call's pieces."""

    def __init__(self, stage: VadStage) -> None:
        self.stage = stage
        self.calls: list[list[str]] = []

    async def run(self, stage: str, fn: Callable[[Any], T]) -> T:
        assert stage == "vad"
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


class Answers:
    """Each piece's answer, in the order they came; `all_in` once `expected` are in."""

    def __init__(self, expected: int) -> None:
        self.got: list[tuple[str, Exception | None]] = []
        self.expected = expected
        self.all_in = asyncio.Event()

    def sender(self, name: str) -> Callable[[Exception | None], None]:
        def fed(error: Exception | None) -> None:
            self.got.append((name, error))
            if len(self.got) == self.expected:
                self.all_in.set()

        return fed


async def test_one_tick_of_pieces_is_one_engine_call() -> None:
    vad = stage()
    for stream in ("a", "b", "c"):
        vad.add(stream, None)
    engine = RecordingEngine(vad)
    feeds = VadFeeds(engine)
    first = Answers(3)
    for stream in ("a", "b", "c"):
        feeds.add(stream, frame(), first.sender(stream))
    await first.all_in.wait()
    second = Answers(1)
    feeds.add("a", frame(), second.sender("a"))
    await second.all_in.wait()
    assert engine.calls == [["a", "b", "c"], ["a"]]
    assert first.got == [("a", None), ("b", None), ("c", None)]


async def test_a_refused_piece_is_answered_to_its_sender_only() -> None:
    vad = stage()
    vad.add("open", None)
    feeds = VadFeeds(RecordingEngine(vad))
    answers = Answers(3)
    feeds.add("open", frame(), answers.sender("fits"))
    feeds.add("closed", frame(), answers.sender("closed"))
    feeds.add("open", frame(2000), answers.sender("too long"))  # more than the stage holds
    await answers.all_in.wait()
    errors = dict(answers.got)
    assert errors["fits"] is None
    assert isinstance(errors["closed"], KeyError)
    assert isinstance(errors["too long"], ValueError)


async def test_a_failing_sender_leaves_the_rest_of_its_batch_answered() -> None:
    vad = stage()
    vad.add("a", None)
    vad.add("b", None)
    feeds = VadFeeds(RecordingEngine(vad))
    answers = Answers(1)

    def failing(error: Exception | None) -> None:
        raise RuntimeError("a sender's bug")

    feeds.add("a", frame(), failing)
    feeds.add("b", frame(), answers.sender("b"))
    await answers.all_in.wait()
    assert answers.got == [("b", None)]
