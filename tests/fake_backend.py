"""Stand-ins for the gateway's `Backend` and `SpeechSource` where no engine runs: a test
subclasses `IdleBackend` with the sessions it needs, and `NoSpeech` hears nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np

from gateway.backend import SpeechEvent
from gateway.session_config import TurnDetection

__all__ = ["IdleBackend", "NoSpeech"]


class IdleBackend:
    """The engine-wide part of a backend whose engine does no work: no requests in
    flight, no prepared turns, no tokens. It opens no session; subclasses add that."""

    def __init__(self) -> None:
        self.closed = False

    def pending(self) -> dict[str, int]:
        return {}

    def prepared_turns(self) -> dict[str, int]:
        return {}

    def llm_tokens(self) -> dict[str, int]:
        return {}

    async def close(self) -> None:
        self.closed = True


class NoSpeech:
    """Server VAD that never hears speech: its events end only when it is closed."""

    def __init__(self) -> None:
        self._closed = asyncio.Event()

    def configure(
        self, settings: TurnDetection | None, start_ms: float, pause_after_ms: int | None = None
    ) -> None:
        """Nothing to set up: no setting makes it hear anything."""

    def feed(self, samples: np.ndarray) -> None:
        """Dropped: there is nothing to hear in it."""

    async def room(self) -> None:
        """Never behind: nothing fed waits to be heard."""

    def watch_words(self) -> None:
        """No speech, so no words to check."""

    async def events(self) -> AsyncIterator[SpeechEvent]:
        await self._closed.wait()
        return
        yield

    async def close(self) -> None:
        self._closed.set()
