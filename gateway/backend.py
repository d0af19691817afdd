"""What the gateway needs from the layers below, as two small interfaces.

`Backend` opens one `BackendSession` per connection (turns in, `TurnOutput`s out) and one
`SpeechSource` per connection for server VAD. `gateway.engine_backend` implements them
over the duplex session manager and the engine's VAD stage; tests implement them with
scripted fakes. Keeping the seam here means no gateway module imports MLX.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from gateway.realtime import PrepareResponse, StartResponse

__all__ = ["Backend", "BackendSession", "SpeechEvent", "SpeechSource", "TurnOutput"]


@dataclass(frozen=True)
class TurnOutput:
    """One engine output of a response: kind "transcript" (of the user audio), "text"
    (an LLM delta), "audio" (PCM16 at `sample_rate` with the text it speaks), "done"
    (with `usage` and `finish` "stop" | "length") or "failed" (`text` says why)."""

    response_id: str
    kind: Literal["transcript", "text", "audio", "done", "failed"]
    text: str = ""
    audio: bytes = b""
    sample_rate: int = 0
    usage: dict[str, Any] | None = None
    finish: str = "stop"


@dataclass(frozen=True)
class SpeechEvent:
    """Server VAD: speech `started` or `stopped` at session time `ms`; `paused` (the
    silence that began at `ms` may become a stop) and `resumed` (it did not)."""

    kind: Literal["started", "stopped", "paused", "resumed"]
    ms: float
    metrics: dict[str, float] = field(default_factory=dict)


class BackendSession(Protocol):
    def start(self, action: StartResponse) -> None:
        """Begin generating a response; its outputs arrive through `outputs()`."""

    def transcribe(self, job_id: str, audio: np.ndarray) -> None:
        """Transcribe 16 kHz `audio` beside any response; its "transcript" and then
        "done" (or "failed") arrive through `outputs()` under `job_id`."""

    def prepare(self, action: PrepareResponse) -> None:
        """Start the work of a response that may be started next, its outputs held
        back; a `start` with an equal prompt takes it over."""

    def discard_prepared(self) -> None:
        """Stop the prepared work, if any."""

    def cancel(self, response_id: str, barge_in: bool) -> None:
        """Stop a response at once; no output of it is needed any more."""

    def outputs(self) -> AsyncIterator[TurnOutput]:
        """Every response's outputs, in order, until `close()`."""

    async def close(self) -> None:
        """Abort everything and release the session; idempotent."""


class SpeechSource(Protocol):
    def configure(self, settings: Any, start_ms: float, pause_after_ms: int | None = None) -> None:
        """Restart detection with new server-VAD settings (None stops it); with
        `pause_after_ms`, silences that long are reported as pauses."""

    def feed(self, samples: np.ndarray) -> None:
        """Float32 16 kHz audio, in order, as the client appends it."""

    def events(self) -> AsyncIterator[SpeechEvent]:
        """Speech decisions, in order, until `close()`."""

    async def close(self) -> None:
        """Stop detection; idempotent."""


class Backend(Protocol):
    models: list[str]

    def open_session(self, session_id: str) -> BackendSession:
        """A session for one connection."""

    def open_speech(self, session_id: str) -> SpeechSource:
        """Server VAD for one connection."""

    def pending(self) -> dict[str, int]:
        """Engine requests in flight per stage (for /metrics)."""

    def prepared_turns(self) -> dict[str, int]:
        """Prepared responses so far, by outcome: "adopted" or "discarded" (for /metrics)."""

    async def close(self) -> None:
        """Stop the engine: every open session's work is aborted."""
