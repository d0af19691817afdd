"""Admission control: a spoken response starts only while the server can keep every
speaking client supplied with audio; otherwise it waits in a bounded queue or is
refused with a `server_busy` error, and the session goes on.

One `Admission` serves the whole server. It counts the spoken responses running and
keeps each one's playback runway (`gateway.server.runway`) from the audio that goes out to
its client. It is saturated when `capacity.max_speaking` spoken responses run, or
when a response that has begun to speak has less than `capacity.runway_floor_s` left
to play. A new spoken response then waits, first come first served, for at most
`capacity.max_wait_s` and behind at most `capacity.max_queued - 1` others; past either
bound it is refused. Waiting responses start, in order, as soon as a running one
finishes or the runways recover. Text-only responses and transcriptions are not
counted and never wait.

`AdmittedBackend` puts it between the connections and the backend: a connection's
`start` of a spoken turn goes through admission; its `cancel` of a waiting one takes it
out of the queue (its `ResponseDone(cancelled)` follows at once, as the backend seam
promises); closing a session takes all of its responses out. Refusals and cancels of
waiting responses are `ResponseDone` events of the session, so the realtime core
finishes them as it finishes any response: an `error` event, then `response.done`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from duplex.turn import Stage, TurnRequest
from gateway.config import CapacitySettings
from gateway.protocol.session_config import TurnDetection
from gateway.server.metrics import GatewayMetrics
from gateway.server.runway import Runway
from gateway.session.backend import (
    Backend,
    BackendSession,
    LiveTranscription,
    ResponseDone,
    ResponseOutput,
    SessionEvent,
)

__all__ = ["BUSY_CODE", "Admission", "AdmittedBackend", "AdmittedSession"]

# The error code of a response refused for capacity (docs/protocol.md, "Capacity").
BUSY_CODE = "server_busy"
_FLOAT32_BYTES = 4


@dataclass
class _Waiting:
    start: Callable[[], None]
    refuse: Callable[[str], None]
    expiry: asyncio.TimerHandle


class Admission:
    def __init__(
        self,
        settings: CapacitySettings,
        metrics: GatewayMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._metrics = metrics
        self._clock = clock
        self._speaking: dict[str, Runway] = {}  # running spoken responses, by response id
        self._waiting: OrderedDict[str, _Waiting] = OrderedDict()

    @property
    def speaking(self) -> int:
        return len(self._speaking)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def saturated(self) -> bool:
        if len(self._speaking) >= self.settings.max_speaking:
            return True
        floor = self.settings.runway_floor_s
        if floor is None:
            return False
        now = self._clock()
        lefts = (runway.left(now) for runway in self._speaking.values())
        return any(left is not None and left < floor for left in lefts)

    def rate_limits(self) -> list[dict[str, float | int | str]]:
        """The `rate_limits.updated` figures: spoken responses that may start now
        ("requests": the limit is `max_speaking`; none remain while saturated), and
        once none remain, the longest a new one would wait before it is refused."""
        limit = self.settings.max_speaking
        remaining = 0 if self.saturated() else limit - len(self._speaking)
        return [
            {
                "name": "requests",
                "limit": limit,
                "remaining": remaining,
                "reset_seconds": 0.0 if remaining else self.settings.max_wait_s,
            }
        ]

    def request(
        self, response_id: str, start: Callable[[], None], refuse: Callable[[str], None]
    ) -> None:
        """Call `start` now, later (in order, once there is room), or `refuse` with the
        reason instead."""
        if not self._waiting and not self.saturated():
            self._metrics.admissions.labels("started").inc()
            self._admit(response_id, start)
            return
        if len(self._waiting) >= self.settings.max_queued:
            self._metrics.admissions.labels("refused").inc()
            refuse(
                f"The server is at capacity ({len(self._speaking)} responses speaking, "
                f"{len(self._waiting)} waiting); try again shortly."
            )
            return
        self._metrics.admissions.labels("queued").inc()
        expiry = asyncio.get_running_loop().call_later(
            self.settings.max_wait_s, self._expire, response_id
        )
        self._waiting[response_id] = _Waiting(start, refuse, expiry)

    def withdraw(self, response_id: str) -> bool:
        """Take a waiting response out of the queue; False if it was not waiting."""
        waiting = self._waiting.pop(response_id, None)
        if waiting is None:
            return False
        waiting.expiry.cancel()
        return True

    def audio(self, response_id: str, seconds: float) -> None:
        """`seconds` of a running response's audio went out to its client."""
        runway = self._speaking.get(response_id)
        if runway is None:
            return
        sent = runway.send(self._clock(), seconds)
        if sent.runway_s is not None:
            self._metrics.playback_runway.observe(max(0.0, sent.runway_s))
        if sent.stall_s > 0:
            self._metrics.playback_stalls.inc()
            self._metrics.playback_stalled_seconds.inc(sent.stall_s)
        self._start_waiting()

    def finished(self, response_id: str) -> None:
        """A running response ended (done, or its session closed)."""
        if self._speaking.pop(response_id, None) is not None:
            self._start_waiting()

    def _admit(self, response_id: str, start: Callable[[], None]) -> None:
        self._speaking[response_id] = Runway()
        start()

    def _start_waiting(self) -> None:
        while self._waiting and not self.saturated():
            response_id, waiting = self._waiting.popitem(last=False)
            waiting.expiry.cancel()
            self._admit(response_id, waiting.start)

    def _expire(self, response_id: str) -> None:
        waiting = self._waiting.pop(response_id, None)
        if waiting is None:
            return
        self._metrics.admissions.labels("expired").inc()
        waiting.refuse(
            f"The server is at capacity: the response waited {self.settings.max_wait_s:g} s "
            "without starting; try again shortly."
        )


class AdmittedSession:
    """A `BackendSession` whose spoken turns start through `Admission`."""

    def __init__(self, inner: BackendSession, admission: Admission) -> None:
        self._inner = inner
        self._admission = admission
        self._waiting: set[str] = set()
        self._speaking: set[str] = set()
        self._events: list[SessionEvent] = []  # refusals and cancels of waiting turns
        self._wake = asyncio.Event()
        self._inner_wait: asyncio.Future[bool] | None = None

    def start(self, response_id: str, turn: TurnRequest, *, conversation: bool) -> None:
        if turn.final is not Stage.TTS:
            self._inner.start(response_id, turn, conversation=conversation)
            return

        def begin() -> None:
            self._waiting.discard(response_id)
            self._speaking.add(response_id)
            self._inner.start(response_id, turn, conversation=conversation)

        self._waiting.add(response_id)
        self._admission.request(response_id, begin, lambda why: self._refused(response_id, why))

    def cancel(self, response_id: str, *, reason: str) -> None:
        if self._admission.withdraw(response_id):
            self._waiting.discard(response_id)
            self._report(ResponseDone(response_id, "cancelled", reason=reason))
        else:
            self._inner.cancel(response_id, reason=reason)

    def prepare(self, turn: TurnRequest) -> None:
        self._inner.prepare(turn)

    def discard_prepared(self) -> None:
        self._inner.discard_prepared()

    def listen(self, options: LiveTranscription | None) -> None:
        self._inner.listen(options)

    def hear(self, samples: np.ndarray) -> None:
        self._inner.hear(samples)

    def detect(
        self, settings: TurnDetection | None, start_ms: float, pause_after_ms: int | None = None
    ) -> None:
        self._inner.detect(settings, start_ms, pause_after_ms)

    def watch_words(self, again: bool = False) -> None:
        self._inner.watch_words(again)

    async def room(self) -> None:
        await self._inner.room()

    def utterance_started(self, utterance_id: str, start_ms: float) -> None:
        self._inner.utterance_started(utterance_id, start_ms)

    def utterance_ended(self, utterance_id: str) -> None:
        self._inner.utterance_ended(utterance_id)

    def take_events(self) -> list[SessionEvent]:
        events, self._events = self._events, []
        self._wake.clear()
        for event in self._inner.take_events():
            if isinstance(event, ResponseOutput | ResponseDone):
                self._account(event)
            events.append(event)
        return events

    async def wait_events(self) -> bool:
        """The backend's events, or a refusal or cancel decided here, whichever is first."""
        if self._events:
            return True
        if self._inner_wait is None:
            self._inner_wait = asyncio.ensure_future(self._inner.wait_events())
        woken: asyncio.Future[bool] = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((self._inner_wait, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        self._wake.clear()
        if not self._inner_wait.done():
            return True
        more, self._inner_wait = self._inner_wait.result(), None
        return more or bool(self._events)

    async def close(self) -> None:
        for response_id in self._waiting:
            self._admission.withdraw(response_id)
        for response_id in self._speaking:
            self._admission.finished(response_id)
        self._waiting.clear()
        self._speaking.clear()
        if self._inner_wait is not None:
            self._inner_wait.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._inner_wait
        await self._inner.close()

    def _account(self, event: ResponseOutput | ResponseDone) -> None:
        if event.response_id not in self._speaking:
            return
        if isinstance(event, ResponseOutput) and event.kind == "audio" and event.sample_rate:
            seconds = len(event.audio) / _FLOAT32_BYTES / event.sample_rate
            self._admission.audio(event.response_id, seconds)
        elif isinstance(event, ResponseDone):
            self._speaking.discard(event.response_id)
            self._admission.finished(event.response_id)

    def _refused(self, response_id: str, message: str) -> None:
        self._waiting.discard(response_id)
        self._report(ResponseDone(response_id, "failed", error=message, error_code=BUSY_CODE))

    def _report(self, done: ResponseDone) -> None:
        self._events.append(done)
        self._wake.set()


class AdmittedBackend:
    """A `Backend` whose sessions start spoken turns through one `Admission`."""

    def __init__(self, backend: Backend, admission: Admission) -> None:
        self._backend = backend
        self.admission = admission

    def open_session(self, session_id: str) -> AdmittedSession:
        return AdmittedSession(self._backend.open_session(session_id), self.admission)

    def pending(self) -> dict[str, int]:
        return self._backend.pending()

    def prepared_turns(self) -> dict[str, int]:
        return self._backend.prepared_turns()

    def llm_tokens(self) -> dict[str, int]:
        return self._backend.llm_tokens()

    def engine_caches(self) -> dict[str, tuple[int | None, int]]:
        return self._backend.engine_caches()

    async def close(self) -> None:
        await self._backend.close()
