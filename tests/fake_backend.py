"""Stand-ins for the gateway's `Backend` and `SpeechSource` where no engine runs: a test
subclasses `IdleBackend` with the sessions it needs, and `NoSpeech` hears nothing.
`RecordsListening` is the live-transcription part of a backend session that
transcribes nothing live: it records what it was told."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np

from gateway.backend import LiveTranscription, SpeechEvent
from gateway.session_config import TurnDetection

__all__ = ["IdleBackend", "NoSpeech", "RecordsListening"]


class RecordsListening:
    """`listen`, `hear`, `utterance_started` and `utterance_ended` of a backend session,
    recorded: `heard` counts the samples, `utterances` lists ("started"/"ended", id)."""

    def __init__(self) -> None:
        self.heard = 0
        self.listening: list[LiveTranscription | None] = []
        self.utterances: list[tuple[str, str]] = []

    def listen(self, options: LiveTranscription | None) -> None:
        self.listening.append(options)

    def hear(self, samples: np.ndarray) -> None:
        self.heard += len(samples)

    def utterance_started(self, utterance_id: str, start_ms: float) -> None:
        self.utterances.append(("started", utterance_id))

    def utterance_ended(self, utterance_id: str) -> None:
        self.utterances.append(("ended", utterance_id))


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

    def engine_caches(self) -> dict[str, tuple[int | None, int]]:
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
