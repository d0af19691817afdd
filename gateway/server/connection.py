"""The asyncio shell around one `RealtimeSession`: WebSocket frames and the backend's
events (engine outputs, speech decisions) in; server events out through one bounded
send queue.

The frames come and go on a `Transport`: the WebSocket, or a WebRTC call's `oai-events`
data channel (`gateway.webrtc.call`, which adds the call's audio tracks to this shell).

Send-queue policy: at most `limits.send_queue_events` server events wait for a client.
A client that stops reading blocks the socket writer (websockets drains at its write
limit), the queue fills, and at the bound the session is closed with code 1008 ("send
queue overflow") and all of its engine work is cancelled. Audio is never silently
dropped from the middle of a response: a gap in speech is worse than a clear close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from typing_extensions import assert_never
from websockets.exceptions import ConnectionClosed

from gateway.config import GatewayConfig
from gateway.protocol.audio import AudioFormat
from gateway.protocol.events import TracingIn, new_id
from gateway.server.metrics import GatewayMetrics
from gateway.session.actions import (
    Action,
    CancelResponse,
    ClearOutputAudio,
    CloseSession,
    ConfigureVad,
    DiscardPrepared,
    EndUtterance,
    Hear,
    Listen,
    PrepareResponse,
    StartResponse,
    StartUtterance,
    WatchWords,
)
from gateway.session.backend import Backend, SpeechDecision
from gateway.session.realtime import RealtimeSession

__all__ = ["RealtimeConnection", "SEND_OVERFLOW_CODE", "Transport", "TransportClosed"]

logger = logging.getLogger(__name__)
# A traced session (`session.tracing`) logs a line here per response, at INFO.
trace_logger = logging.getLogger("gateway.trace")

SEND_OVERFLOW_CODE = 1008
INTERNAL_ERROR_CODE = 1011
IDLE_REASON = "idle session closed to make room for a new one"


class TransportClosed(Exception):
    """The peer is gone: what a transport other than the WebSocket raises on `send`."""


class Transport(Protocol):
    """Where a session's client frames come from and its events go: websockets'
    `ServerConnection` is one; iterating ends (or raises ConnectionClosed) at the close."""

    def __aiter__(self) -> AsyncIterator[str | bytes]: ...

    async def send(self, message: str) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


class RealtimeConnection:
    def __init__(
        self,
        websocket: Transport,
        backend: Backend,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        *,
        model: str,
        beta: bool,
        rate_limits: Callable[[], list[dict[str, Any]]] | None = None,
        media_format: AudioFormat | None = None,
    ) -> None:
        self.websocket = websocket
        self.config = config
        self.metrics = metrics
        self.core = RealtimeSession(
            config=config, model=model, beta=beta, media_format=media_format
        )
        self.session = backend.open_session(self.core.settings.id)
        self._queue: deque[str] = deque()
        self._ready = asyncio.Event()
        self._close: CloseSession | None = None
        self._done = asyncio.Event()
        self._speech_stopped_at: float | None = None
        self._created_at: dict[str, float] = {}
        self._running: set[str] = set()  # responses created and not yet done
        self._close_when_idle: CloseSession | None = None
        self._rate_limits = rate_limits
        self._active_at = time.monotonic()  # the last server event queued for it
        self.released = asyncio.Event()  # set once everything it held is freed

    @property
    def session_id(self) -> str:
        return self.core.settings.id

    def idle_for(self, now: float) -> float:
        """Seconds without a running response or any server event: 0 while it is busy.
        Everything a user does (speech the VAD detects, a transcript, a reply to a
        client event) makes the gateway send something, so silence reads as idle."""
        return 0.0 if self._running or self._done.is_set() else now - self._active_at

    def close_idle(self) -> None:
        """Close with 1001: the session gives its place to a new connection."""
        self._finish(CloseSession(1001, IDLE_REASON))

    async def run(self) -> None:
        """Serve the connection until the client leaves, a limit hits, or `shutdown`."""
        self._pump()
        tasks = [
            asyncio.create_task(self._read(), name="realtime-read"),
            asyncio.create_task(self._send(), name="realtime-send"),
            asyncio.create_task(self._outputs(), name="realtime-outputs"),
        ]
        for task in tasks:
            task.add_done_callback(self._task_ended)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), self.config.limits.max_session_s)
            if self._close is None:
                self._close = CloseSession(
                    1001,
                    "Your session hit the maximum duration of "
                    f"{self.config.limits.max_session_s:g} seconds.",
                )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await self._release()
            finally:
                self.released.set()

    async def shutdown(self, reason: str) -> None:
        """Close from the server side (graceful shutdown): code 1001 with `reason`."""
        self._finish(CloseSession(1001, reason))

    def close_when_idle(self, reason: str) -> None:
        """Close with 1001 and `reason` once no response is running (now, if none is)."""
        self._close_when_idle = CloseSession(1001, reason)
        if not self._running:
            self._finish(self._close_when_idle)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        # A failure in a task of the connection is a bug: close with 1011, no details.
        if task.cancelled() or task.exception() is None:
            return
        logger.error(
            "session %s: %s failed", self.session_id, task.get_name(), exc_info=task.exception()
        )
        self._finish(CloseSession(INTERNAL_ERROR_CODE, "internal error"))

    def _finish(self, close: CloseSession | None) -> None:
        if self._close is None:
            self._close = close
        self._done.set()

    async def _release(self) -> None:
        self.core.close()
        self._dispatch(self.core.actions())
        await self.session.close()
        if self._close is not None and self._close.code != SEND_OVERFLOW_CODE:
            # Events already decided (an error before the close, say) still go out.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._flush(), 1.0)
        if self._close is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self.websocket.close(self._close.code, self._close.reason), 2.0
                )

    # -- inputs -------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            async for frame in self.websocket:
                if isinstance(frame, bytes):
                    self.core.receive_binary(len(frame))
                else:
                    self.core.receive_text(frame)
                self._pump()
                await self.session.room()
        except (ConnectionClosed, TransportClosed):
            pass
        finally:
            self._finish(None)

    async def _outputs(self) -> None:
        while await self.session.wait_events():
            self._pump()

    def _apply_speech(self, event: SpeechDecision) -> None:
        match event.kind:
            case "started":
                self.core.speech_started(event.ms)
            case "paused":
                self.core.speech_paused(event.ms)
            case "resumed":
                self.core.speech_resumed()
            case "confirmed":
                self.core.speech_confirmed(event.ms, event.words)
            case "stopped":
                self._speech_stopped_at = time.monotonic()
                self.core.speech_stopped(event.ms)
            case _:
                assert_never(event.kind)

    # -- outputs ------------------------------------------------------------------------

    def _pump(self) -> None:
        """Move the core's events to the send queue and carry out its actions, then feed
        the backend's events to the core, until nothing more is decided.

        What the core decided goes out and down before the backend's next events come
        in: a barge-in cancels its response below (the duplex fence drops the outputs
        still queued for it) before any of those outputs can reach the core. A cancel's
        `ResponseDone` is ready as soon as the cancel is carried out, so its
        `response.done` goes out in the same step as the event that caused it."""
        while True:
            self._send_events(self.core.events_to_send())
            actions = self.core.actions()
            self._dispatch(actions)
            backend_events = self.session.take_events()
            for backend_event in backend_events:
                if isinstance(backend_event, SpeechDecision):
                    self._apply_speech(backend_event)  # the last one taken (`take_events`)
                else:
                    self.core.receive_response_event(backend_event)
            if not actions and not backend_events:
                break
        if len(self._queue) > self.config.limits.send_queue_events:
            self.metrics.send_overflows.inc()
            self._queue.clear()
            self._finish(
                CloseSession(SEND_OVERFLOW_CODE, "send queue overflow: client is not reading")
            )

    def _send_events(self, events: list[dict[str, Any]]) -> None:
        if self._done.is_set():
            return  # closing: nothing more is sent
        for event in events:
            self._queue_event(event)
            if event["type"] == "response.done" and self._rate_limits is not None:
                # As the service does: the limits as they stand once a response is done.
                limits = self._rate_limits()
                self._queue_event(
                    {
                        "type": "rate_limits.updated",
                        "event_id": new_id("event"),
                        "rate_limits": limits,
                    }
                )
        if events:
            self._ready.set()

    def _queue_event(self, event: dict[str, Any]) -> None:
        self._observe(event)
        self._queue.append(json.dumps(event, separators=(",", ":")))

    def _dispatch(self, actions: list[Action]) -> None:
        for action in actions:
            self._carry_out(action)

    def _carry_out(self, action: Action) -> None:
        match action:
            case StartResponse(response_id, turn, conversation):
                self.session.start(response_id, turn, conversation=conversation)
            case PrepareResponse(turn):
                self.session.prepare(turn)
            case DiscardPrepared():
                self.session.discard_prepared()
            case CancelResponse(response_id, reason):
                self.session.cancel(response_id, reason=reason)
            case Hear(samples):
                self.session.hear(samples)
            case StartUtterance(item_id, start_ms):
                self.session.utterance_started(item_id, start_ms)
            case EndUtterance(item_id):
                self.session.utterance_ended(item_id)
            case Listen(options):
                self.session.listen(options)
            case ConfigureVad(settings, start_ms, pause_after_ms):
                self.session.detect(settings, start_ms, pause_after_ms)
            case WatchWords(again):
                self.session.watch_words(again)
            case ClearOutputAudio():
                self._clear_output_audio()
            case CloseSession():
                self._finish(action)
            case _:
                assert_never(action)

    def _clear_output_audio(self) -> None:
        """Only a call's core asks for it (`gateway.webrtc.call`): a WebSocket client plays and
        truncates its audio itself."""

    def _observe(self, event: dict[str, Any]) -> None:
        """Count a server event about to be queued for the client."""
        kind = event["type"]
        self._active_at = time.monotonic()
        self.metrics.events_sent.inc()
        if kind == "error":
            self.metrics.errors.labels(event["error"]["code"] or "none").inc()
        elif kind == "response.created":
            self._created_at[event["response"]["id"]] = time.monotonic()
            self._running.add(event["response"]["id"])
        elif kind in ("response.output_audio.delta", "response.audio.delta"):
            self._first_output(event["response_id"])
            if self._speech_stopped_at is not None:
                self.metrics.first_audio.observe(time.monotonic() - self._speech_stopped_at)
                self._speech_stopped_at = None
        elif kind in ("response.output_text.delta", "response.text.delta"):
            self._first_output(event["response_id"])
        elif kind == "response.done":
            self._response_done(event["response"])

    def _response_done(self, response: dict[str, Any]) -> None:
        self._created_at.pop(response["id"], None)
        self._running.discard(response["id"])
        if self._close_when_idle is not None and not self._running:
            self._finish(self._close_when_idle)
        self.metrics.turns.labels(response["status"]).inc()
        details = response["status_details"] or {}
        if response["status"] == "cancelled" and details.get("reason") == "turn_detected":
            self.metrics.barge_ins.inc()
        self._trace(response)

    def _trace(self, response: dict[str, Any]) -> None:
        """The session's trace: with `tracing` on, a log line per response, under its
        workflow name and group ("auto": workflow "realtime", the session as group)."""
        tracing = self.core.settings.tracing
        if tracing is None:
            return
        given = tracing if isinstance(tracing, TracingIn) else TracingIn()
        usage = response.get("usage") or {}
        trace_logger.info(
            "trace workflow=%s group=%s session=%s response=%s status=%s "
            "input_tokens=%s output_tokens=%s metadata=%s",
            given.workflow_name or "realtime",
            given.group_id or self.session_id,
            self.session_id,
            response["id"],
            response["status"],
            usage.get("input_tokens"),
            usage.get("output_tokens"),
            json.dumps(given.metadata) if given.metadata else "{}",
        )

    def _first_output(self, response_id: str) -> None:
        created = self._created_at.pop(response_id, None)
        if created is not None:
            self.metrics.first_text.observe(time.monotonic() - created)

    async def _flush(self) -> None:
        while self._queue:
            await self.websocket.send(self._queue.popleft())

    async def _send(self) -> None:
        try:
            while True:
                await self._ready.wait()
                while self._queue:
                    await self.websocket.send(self._queue.popleft())
                self._ready.clear()
        except (ConnectionClosed, TransportClosed):
            self._finish(None)
