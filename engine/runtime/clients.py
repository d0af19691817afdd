"""Typed calls on the engine's stages.

A call runs a function of the stage on the engine thread that owns it (`AsyncEngine.run`,
or `notify` when nothing waits for it). The client of a stage names the stage's type, so
mypy checks every method called on it and its arguments:

    live = await clients.asr(engine).run(lambda asr: asr.new_live_transcript(prompt))
    clients.llm(engine).notify(lambda llm: llm.set_runway(request_id, seconds))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # the stages' modules load models: only their types are needed here
    from engine.llm.stage import LlmStage
    from engine.runtime.core import AsyncEngine
    from engine.stages.asr import AsrStage
    from engine.stages.tts import TtsStage
    from engine.stages.vad import VadStage

__all__ = ["StageClient", "asr", "llm", "tts", "vad"]

S = TypeVar("S")
T = TypeVar("T")


class StageClient(Generic[S]):
    """Calls on the stage `name` of `engine`, whose type is `S`."""

    def __init__(self, engine: AsyncEngine, name: str) -> None:
        self._engine = engine
        self.name = name

    async def run(self, fn: Callable[[S], T]) -> T:
        """`fn(stage)` on the engine thread, in order with the stage's adds; its result,
        or its error raised here."""
        return await self._engine.run(self.name, fn)

    def notify(self, fn: Callable[[S], object]) -> None:
        """`fn(stage)` on the engine thread, not waited for (a hint: its result and any
        error are dropped)."""
        self._engine.notify(self.name, fn)


def asr(engine: AsyncEngine) -> StageClient[AsrStage]:
    return StageClient(engine, "asr")


def llm(engine: AsyncEngine) -> StageClient[LlmStage]:
    return StageClient(engine, "llm")


def tts(engine: AsyncEngine) -> StageClient[TtsStage]:
    return StageClient(engine, "tts")


def vad(engine: AsyncEngine) -> StageClient[VadStage]:
    return StageClient(engine, "vad")
