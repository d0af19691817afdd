"""The gateway's `Backend` over the duplex session manager.

One realtime connection owns one duplex session. Every turn of the connection runs in
it under the gateway's response id as its tag: the conversation's responses as the
conversation's turns, out-of-band responses and transcriptions as side turns. Commands
reach the duplex session synchronously, in the order the realtime core decided them, and
`take_events()` reads the duplex session's event queue directly, with no queue in
between, so the duplex fence is the one place stale output is dropped.

What the session hears and how (`hear`, `detect`, `watch_words`, `utterance_started`,
`utterance_ended`, `listen`) goes to the duplex session's resident stage-0 request as
appends (`duplex.appends`): every sample once, while speech is detected or transcribed
live. Its speech decisions and live transcript deltas come back among the events, as
`SpeechDecision`s and `TranscriptDelta`s. Server-VAD settings are the protocol's; this
module turns them, with the profile's turn-taking thresholds, into the typed `Detect`.

Heard audio goes down a VAD window at a time (`HEAR_WINDOW_SAMPLES`): the samples of a
frame wait until a window more of the session clock is complete, which is as soon as the
VAD below can act on them, so a 20 ms frame costs the event loop fewer appends. Any other
append sends what waits first, so the resident request hears everything in order.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Literal, Protocol

import numpy as np

from duplex.appends import (
    Append,
    Detect,
    Heard,
    Listen,
    UtteranceEnded,
    UtteranceStarted,
    WatchWords,
)
from duplex.errors import DuplexError
from duplex.events import SpeechDecision, TurnDone, TurnOutput, UtteranceOutput
from duplex.manager import DuplexSessionHandle, DuplexSessionManager
from duplex.outputs import DuplexStageOutput
from duplex.turn import TurnRequest
from gateway.config import TurnSettings
from gateway.protocol.session_config import TurnDetection
from gateway.session.backend import (
    LiveTranscription,
    ResponseDone,
    ResponseOutput,
    SessionEvent,
    TokenLogprob,
    TranscriptDelta,
)

__all__ = ["HEAR_WINDOW_SAMPLES", "EngineBackend", "EngineBackendSession", "detect_append"]

logger = logging.getLogger(__name__)

# Silero VAD's window: 32 ms at 16 kHz.
HEAR_WINDOW_SAMPLES = 512


class EngineBackendSession:
    """One connection's turns, as one duplex session."""

    def __init__(self, handle: DuplexSessionHandle, turns: TurnSettings | None = None) -> None:
        self._handle = handle
        self._turns = turns or TurnSettings()
        self._listening = False
        self._detecting = False
        self._clock = 0  # samples heard, sent or not
        self._unsent: list[np.ndarray] = []  # heard, waiting for a window's end
        self._unsent_samples = 0

    def start(self, response_id: str, turn: TurnRequest, *, conversation: bool) -> None:
        try:
            self._handle.start_turn(turn, tag=response_id, conversation=conversation)
        except (DuplexError, ValueError) as exc:
            self._handle.reject_turn(response_id, str(exc))

    def prepare(self, turn: TurnRequest) -> None:
        try:
            self._handle.prepare_turn(turn)
        except (DuplexError, ValueError) as exc:
            # Only an optimisation: the turn itself reports what is wrong when it starts.
            logger.debug("turn not prepared on %s: %s", self._handle.session_id, exc)

    def discard_prepared(self) -> None:
        self._handle.discard_prepared()

    def cancel(self, response_id: str, *, reason: str) -> None:
        self._handle.cancel(tag=response_id, reason=reason)

    def listen(self, options: LiveTranscription | None) -> None:
        self._listening = options is not None
        if options is None:
            self._append(Listen(enabled=False, clock=self._clock))
        else:
            self._append(
                Listen(prompt=options.prompt, logprobs=options.logprobs, clock=self._clock)
            )

    def hear(self, samples: np.ndarray) -> None:
        # Only audio something hears goes down: a session without server VAD or live
        # transcription would cost every frame a trip through the engine for nothing.
        self._clock += samples.size
        if not samples.size or not (self._listening or self._detecting):
            return
        self._unsent.append(samples.astype("<f4", copy=False))
        self._unsent_samples += samples.size
        first = self._clock - self._unsent_samples
        if self._clock // HEAR_WINDOW_SAMPLES > first // HEAR_WINDOW_SAMPLES:
            self._send_heard()

    def detect(
        self, settings: TurnDetection | None, start_ms: float, pause_after_ms: int | None = None
    ) -> None:
        if settings is None and not self._detecting:
            return  # nothing to stop: no need to open the resident request for it
        self._detecting = settings is not None
        self._append(detect_append(settings, start_ms, self._clock, pause_after_ms, self._turns))

    def watch_words(self, again: bool = False) -> None:
        self._append(WatchWords(again))

    async def room(self) -> None:
        await self._handle.room()

    def utterance_started(self, utterance_id: str, start_ms: float) -> None:
        self._append(UtteranceStarted(utterance_id, max(start_ms, 0.0)))

    def utterance_ended(self, utterance_id: str) -> None:
        self._append(UtteranceEnded(utterance_id))

    def _send_heard(self) -> None:
        if not self._unsent:
            return
        audio = b"".join(samples.tobytes() for samples in self._unsent)
        self._unsent.clear()
        self._unsent_samples = 0
        self._submit(Heard(audio))

    def _append(self, value: Append) -> None:
        self._send_heard()  # what was heard before `value` reaches the engine before it
        self._submit(value)

    def _submit(self, value: Append) -> None:
        try:
            self._handle.append(value)
        except DuplexError as exc:  # closing: nothing more is heard
            logger.debug("append dropped on %s: %s", self._handle.session_id, exc)

    def take_events(self) -> list[SessionEvent]:
        events: list[SessionEvent] = []
        for event in self._handle.take_events():
            if isinstance(event, TurnOutput) and event.tag is not None:
                events.append(_response_output(event.tag, event))
            elif isinstance(event, TurnDone) and event.tag is not None:
                events.append(_response_done(event.tag, event))
            elif isinstance(event, UtteranceOutput):
                out = event.output
                events.append(TranscriptDelta(event.utterance_id, out.text, _logprobs(out)))
            elif isinstance(event, SpeechDecision):
                events.append(event)
        return events

    async def wait_events(self) -> bool:
        return await self._handle.wait_events()

    async def close(self) -> None:
        await self._handle.close()


def detect_append(
    settings: TurnDetection | None,
    start_ms: float,
    clock: int,
    pause_after_ms: int | None,
    turns: TurnSettings,
) -> Detect:
    """The resident request's `Detect` for the protocol's turn detection `settings`
    (None: off), with the profile's thresholds `turns`."""
    if settings is None:
        return Detect(enabled=False, start_ms=start_ms, clock=clock)
    semantic = settings.semantic
    return Detect(
        start_ms=start_ms,
        clock=clock,
        threshold=settings.threshold,
        prefix_padding_ms=settings.prefix_padding_ms,
        silence_ms=settings.max_wait_ms if semantic else settings.silence_duration_ms,
        semantic=semantic,
        pause_after_ms=pause_after_ms,
        unsure_wait_ms=int(settings.max_wait_ms * turns.semantic_unsure_wait),
        score_after_ms=turns.semantic_score_after_ms,
        rescore_ms=turns.semantic_rescore_ms,
        complete_threshold=turns.semantic_complete_threshold,
        words=turns.semantic_words,
        words_after_ms=turns.semantic_words_after_ms,
        interruption_words_after_ms=turns.interruption_words_after_ms,
        interruption_words_every_ms=turns.interruption_words_every_ms,
        min_interruption_ms=turns.min_interruption_ms,
    )


def _response_output(response_id: str, event: TurnOutput) -> ResponseOutput:
    out = event.output
    kind = _FORWARDED_KINDS.get(out.kind)
    if kind is None:
        raise RuntimeError(f"the duplex session forwarded a {out.kind!r} output")
    if kind == "tool_call":
        index, name = out.metadata.get("index"), out.metadata.get("name")
        if not isinstance(index, int) or not isinstance(name, str):
            raise RuntimeError("a tool_call output needs an int index and a str name")
        return ResponseOutput(response_id, kind, text=out.text, call_index=index, name=name)
    return ResponseOutput(
        response_id,
        kind,
        text=out.text,
        audio=out.audio,
        sample_rate=out.sample_rate,
        logprobs=_logprobs(out),
    )


def _logprobs(out: DuplexStageOutput) -> tuple[TokenLogprob, ...]:
    """The `(token, logprob)` pairs a transcript output carries, in the protocol's form."""
    pairs = out.metadata.get("logprobs")
    if not isinstance(pairs, (tuple, list)):
        return ()
    return tuple(
        TokenLogprob(str(token), float(logprob), tuple(str(token).encode()))
        for token, logprob in pairs
    )


_FORWARDED_KINDS: dict[str, Literal["transcript", "text", "audio", "tool_call"]] = {
    "transcript": "transcript",
    "text": "text",
    "audio": "audio",
    "tool_call": "tool_call",
}


def _response_done(response_id: str, event: TurnDone) -> ResponseDone:
    return ResponseDone(
        response_id,
        event.status,
        reason=event.reason,
        usage=_token_counts(event.usage),
        error=event.error,
        error_code=event.error_code,
    )


def _token_counts(usage: Mapping[str, object]) -> dict[str, int]:
    return {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}


class EngineCounts(Protocol):
    """The part of the engine /metrics reads."""

    def pending(self) -> dict[str, int]:
        """Requests accepted and not yet finished, per stage."""


class EngineBackend:
    """`Backend` over an engine bundle: `manager` for the sessions, `engine` for the
    counts /metrics shows."""

    def __init__(
        self,
        manager: DuplexSessionManager,
        engine: EngineCounts,
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
        llm_tokens: Callable[[], dict[str, int]] | None = None,
        caches: Callable[[], dict[str, tuple[int | None, int]]] | None = None,
        turns: TurnSettings | None = None,
    ) -> None:
        self.manager = manager
        self.engine = engine
        self._turn_settings = turns
        self._on_close = on_close
        self._llm_tokens = llm_tokens
        self._caches = caches

    def open_session(self, session_id: str) -> EngineBackendSession:
        return EngineBackendSession(self.manager.open(session_id), self._turn_settings)

    @property
    def semantic_vad(self) -> bool:
        """Whether the engine runs the turn-end model semantic_vad asks."""
        return "turn" in self.engine.pending()

    def pending(self) -> dict[str, int]:
        return self.engine.pending()

    def llm_tokens(self) -> dict[str, int]:
        return self._llm_tokens() if self._llm_tokens is not None else {}

    def engine_caches(self) -> dict[str, tuple[int | None, int]]:
        return self._caches() if self._caches is not None else {}

    def prepared_turns(self) -> dict[str, int]:
        # A port that never works ahead has no such counts.
        return dict(getattr(self.manager.port, "prepare_stats", {}))

    async def close(self) -> None:
        await self.manager.close_all()
        if self._on_close is not None:
            await self._on_close()
