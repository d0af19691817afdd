"""`engine.listening.speech_detection.SpeechDetection` driven as the gateway drives it, for tests
that run it without a listener: settings in the protocol's shape (turned into the
resident request's `Detect` by the gateway's own `detect_append`), the audio fed kept
for its clips, and its decisions read in order from `events()`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np

from duplex.events import SpeechDecision
from engine.listening.listener import HeardAudio
from engine.listening.speech_detection import SAMPLES_PER_MS, SpeechDetection
from engine.listening.vad_feeder import VadEngine
from gateway.config import TurnSettings
from gateway.protocol.session_config import TurnDetection
from gateway.session.engine_backend import detect_append

__all__ = ["DetectionHarness"]


class DetectionHarness:
    def __init__(self, engine: VadEngine, session_id: str, turns: TurnSettings | None = None):
        self.turns = turns or TurnSettings()
        self.heard = HeardAudio()
        self._origin = 0
        self._events: asyncio.Queue[SpeechDecision | None] = asyncio.Queue()
        self.detection = SpeechDetection(engine, session_id, self._clip, self._events.put_nowait)

    def configure(
        self, settings: TurnDetection | None, start_ms: float, pause_after_ms: int | None = None
    ) -> None:
        self._origin = self.heard.end
        detect = detect_append(settings, start_ms, self.heard.end, pause_after_ms, self.turns)
        self.detection.configure(detect)

    def feed(self, samples: np.ndarray) -> None:
        self.heard.append(samples)
        self.detection.feed(samples)

    async def room(self) -> None:
        await self.detection.room()

    def watch_words(self, again: bool = False) -> None:
        self.detection.watch_words(again)

    def turn_taken(self) -> None:
        self.detection.turn_taken()

    @property
    def scoring(self) -> bool:
        return self.detection.scoring

    async def events(self) -> AsyncIterator[SpeechDecision]:
        while (event := await self._events.get()) is not None:
            yield event

    async def close(self) -> None:
        self.detection.close()
        self._events.put_nowait(None)

    def _clip(self, start_ms: int, end_ms: int) -> np.ndarray:
        origin = self._origin
        return self.heard.between(
            origin + start_ms * SAMPLES_PER_MS, origin + end_ms * SAMPLES_PER_MS
        )
