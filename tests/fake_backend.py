"""Stand-ins for the gateway's `Backend` where no engine runs.

`ScriptedSession` is the one fake `BackendSession`: it records what the connection asks
of it and runs each started turn through the test's `Reply` script (none: the test puts
the events itself). A test subclasses `IdleBackend` with the sessions it needs.
`RecordsListening` is the input part of a backend session (what it hears, and how):
it records what it was told, and passes the audio to a `FakeSpeech` if it has one
(none: it detects no speech)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np

from duplex.turn import TurnRequest
from gateway.protocol.session_config import TurnDetection
from gateway.session.backend import LiveTranscription, ResponseDone, SessionEvent, SpeechDecision

__all__ = ["FakeSpeech", "IdleBackend", "RecordsListening", "Reply", "ScriptedSession"]


class FakeSpeech(Protocol):
    """A speech detector stand-in: hears the session's audio, reports its decisions
    through the `emit` it was given."""

    def configure(
        self, settings: TurnDetection | None, start_ms: float, pause_after_ms: int | None
    ) -> None: ...

    def feed(self, samples: np.ndarray) -> None: ...


class RecordsListening:
    """The input side of a backend session, recorded: `heard` counts the samples,
    `utterances` lists ("started"/"ended", id), `detecting` the turn detection settings
    given, `watched` the `watch_words` calls' `again`."""

    def __init__(self) -> None:
        self.heard = 0
        self.listening: list[LiveTranscription | None] = []
        self.utterances: list[tuple[str, str]] = []
        self.detecting: list[TurnDetection | None] = []
        self.watched: list[bool] = []
        self.speech: FakeSpeech | None = None

    def listen(self, options: LiveTranscription | None) -> None:
        self.listening.append(options)

    def hear(self, samples: np.ndarray) -> None:
        self.heard += len(samples)
        if self.speech is not None:
            self.speech.feed(samples)

    def detect(
        self, settings: TurnDetection | None, start_ms: float, pause_after_ms: int | None = None
    ) -> None:
        self.detecting.append(settings)
        if self.speech is not None:
            self.speech.configure(settings, start_ms, pause_after_ms)

    def watch_words(self, again: bool = False) -> None:
        self.watched.append(again)

    async def room(self) -> None:
        """Never behind: nothing heard waits to be processed."""

    def utterance_started(self, utterance_id: str, start_ms: float) -> None:
        self.utterances.append(("started", utterance_id))

    def utterance_ended(self, utterance_id: str) -> None:
        self.utterances.append(("ended", utterance_id))


Reply = Callable[["ScriptedSession", str, TurnRequest], Awaitable[None]]
"""A turn's script: `reply(session, response_id, turn)` runs as a task from `start` and
puts the turn's outputs and its `ResponseDone` with `session.put`."""


class ScriptedSession(RecordsListening):
    """A backend session whose turns follow `reply` (module docstring).

    Like the duplex fence, `cancel` ends a running turn at once with its cancelled
    `ResponseDone` (its script is cancelled), and nothing of that turn follows it.
    Records: `turns` (every started turn, by response id, in order), `cancelled`
    (`(response_id, reason)` pairs), `prepared` (the turn prepared now) and `adopted`
    (conversation turns that took over the prepared one). `closed`, when given, is set
    once the session is closed.
    """

    def __init__(self, reply: Reply | None = None, *, closed: asyncio.Event | None = None) -> None:
        super().__init__()
        self.reply = reply
        self.closed = closed
        self.is_closed = False
        self.queue: deque[SessionEvent] = deque()
        self.arrived = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.turns: dict[str, TurnRequest] = {}
        self.cancelled: list[tuple[str, str]] = []
        self.prepared: TurnRequest | None = None
        self.adopted: list[str] = []
        self._running: set[str] = set()

    def start(self, response_id: str, turn: TurnRequest, *, conversation: bool) -> None:
        self.turns[response_id] = turn
        self._running.add(response_id)
        if conversation:
            if turn == self.prepared:
                self.adopted.append(response_id)
            self.prepared = None
        if self.reply is not None:
            self.tasks[response_id] = asyncio.create_task(self.reply(self, response_id, turn))

    def put(self, event: SessionEvent) -> None:
        """Queue one event for the connection (a script's outputs, or the test's)."""
        if isinstance(event, ResponseDone):
            self._running.discard(event.response_id)
        self.queue.append(event)
        self.arrived.set()

    def prepare(self, turn: TurnRequest) -> None:
        self.prepared = turn

    def discard_prepared(self) -> None:
        self.prepared = None

    def cancel(self, response_id: str, *, reason: str) -> None:
        self.cancelled.append((response_id, reason))
        task = self.tasks.get(response_id)
        if task is not None:
            task.cancel()
        if response_id in self._running:
            self.put(ResponseDone(response_id, "cancelled", reason=reason))

    async def ended(self, response_id: str) -> None:
        """Return once the turn's script has stopped: nothing more of it can come."""
        await asyncio.wait([self.tasks[response_id]])

    def take_events(self) -> list[SessionEvent]:
        """Like the duplex session's: up to and including the first speech decision."""
        events: list[SessionEvent] = []
        while self.queue:
            events.append(self.queue.popleft())
            if isinstance(events[-1], SpeechDecision):
                break
        return events

    async def wait_events(self) -> bool:
        while not self.queue and not self.is_closed:
            self.arrived.clear()
            await self.arrived.wait()
        return bool(self.queue)

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.is_closed = True
        self.arrived.set()
        if self.closed is not None:
            self.closed.set()


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
