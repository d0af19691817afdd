"""What the gateway needs from the layers below, as two small interfaces.

`Backend` opens one `BackendSession` per connection: typed turns and the session's input
(its audio, the speech detection's settings) in; response outputs, live transcript
deltas and speech decisions out, in one ordered stream of events.
`gateway.session.engine_backend` implements it over the duplex session manager; tests implement
it with scripted fakes. Keeping the seam here means no gateway module imports the engine.

Identity: the gateway's response id (or transcription job id) is the one name of a turn
from start to done. It goes down with `start` and comes back on every output.

Each started turn ends with exactly one `ResponseDone`, and no output of it follows
that. A cancel ends the turn in the layer below (the duplex fence), which then reports
`ResponseDone(status="cancelled")`; the gateway finishes the response on that event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from duplex.events import SpeechDecision
from duplex.turn import TurnRequest
from gateway.protocol.session_config import LiveTranscription, TurnDetection

__all__ = [
    "Backend",
    "BackendSession",
    "LiveTranscription",
    "ResponseDone",
    "ResponseEvent",
    "ResponseOutput",
    "SessionEvent",
    "SpeechDecision",
    "TokenLogprob",
    "TranscriptDelta",
]


@dataclass(frozen=True)
class TokenLogprob:
    """One transcript token and its log probability (`include` asks for them)."""

    token: str
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True)
class ResponseOutput:
    """One output of a running turn: kind "transcript" (of the user audio), "text" (an
    LLM delta), "audio" (float32 little-endian mono samples at `sample_rate`, with the
    text they speak in `text`) or "tool_call" (a delta of the arguments of call number
    `call_index` of the reply, a call of function `name`)."""

    response_id: str
    kind: Literal["transcript", "text", "audio", "tool_call"]
    text: str = ""
    audio: bytes = b""
    sample_rate: int = 0
    call_index: int = 0
    name: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # "transcript" only, when the turn asked


@dataclass(frozen=True)
class ResponseDone:
    """The one terminal event of a turn. `usage` is the engine's chat-completions usage
    (`prompt_tokens`, `completion_tokens`, `cached_tokens`), empty when none was reported;
    `reason` is set for "incomplete" ("max_output_tokens") and "cancelled" (the reason
    given to `cancel`); `error` for "failed", with `error_code` when the engine refused
    the turn for what it asked (a limit)."""

    response_id: str
    status: Literal["completed", "incomplete", "cancelled", "failed"]
    reason: str | None = None
    usage: Mapping[str, int] = field(default_factory=dict)
    error: str | None = None
    error_code: str | None = None


ResponseEvent = ResponseOutput | ResponseDone


@dataclass(frozen=True)
class TranscriptDelta:
    """Words of the utterance being spoken (`utterance_id`, the item id `speech_started`
    named) that the resident speech-to-text has settled on. Deltas of one utterance are
    only ever appended, never retracted: their concatenation is a prefix of the final
    transcript (the `transcript` output of the turn whose `utterance` names it)."""

    utterance_id: str
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


# Server VAD's decisions (`duplex.events.SpeechDecision`) come among the events too.
SessionEvent = ResponseEvent | TranscriptDelta | SpeechDecision


class BackendSession(Protocol):
    def start(self, response_id: str, turn: TurnRequest, *, conversation: bool) -> None:
        """Run `turn` now; its outputs and its `ResponseDone` come through `take_events()`
        under `response_id`. The conversation's turn (`conversation=True`, at most one at
        a time) is the one a barge-in cancels; other turns (out-of-band responses,
        transcription jobs) run beside it. A turn that cannot start ends at once with a
        failed `ResponseDone`."""

    def prepare(self, turn: TurnRequest) -> None:
        """Start the work of the conversation turn that may be started next, its outputs
        held back; a `start` of an equal turn takes it over."""

    def discard_prepared(self) -> None:
        """Stop the prepared work, if any."""

    def cancel(self, response_id: str, *, reason: str) -> None:
        """End a running turn at once; "turn_detected" is a barge-in. Its `ResponseDone`
        (cancelled, or whatever ended it first) follows; nothing if it already ended."""

    def listen(self, options: LiveTranscription | None) -> None:
        """Transcribe speech live with `options` from now on; None stops it (no
        `TranscriptDelta` comes, and no live work is done)."""

    def hear(self, samples: np.ndarray) -> None:
        """Every appended sample of the session, float32 at 16 kHz, in order, once: the
        session clock is the count of samples heard (`ms * 16`). Server VAD and live
        transcription both hear these."""

    def detect(
        self, settings: TurnDetection | None, start_ms: float, pause_after_ms: int | None = None
    ) -> None:
        """Restart speech detection at session time `start_ms` with new server-VAD
        settings (None stops it); its `SpeechDecision`s come among the events. With
        `pause_after_ms`, silences that long are reported as pauses (semantic_vad
        scores the turn then)."""

    def watch_words(self, again: bool = False) -> None:
        """Check the words of the speech under way: if they are more than a backchannel,
        report it `confirmed` before it has lasted the minimum interruption. `again`: its
        confirmation did not count (`WatchWords`); count its length from now."""

    async def room(self) -> None:
        """Return once the audio heard and not yet through speech detection is within
        its bound: the connection reads no more of the client's frames until then."""

    def utterance_started(self, utterance_id: str, start_ms: float) -> None:
        """Speech began at session time `start_ms`: while listening, transcribe it live
        as `utterance_id` and report `TranscriptDelta`s."""

    def utterance_ended(self, utterance_id: str) -> None:
        """No more live work for `utterance_id`: it was committed (its turn, started with
        `TurnRequest.utterance`, finishes the transcript) or dropped."""

    def take_events(self) -> list[SessionEvent]:
        """The turns' outputs and done events, live transcript deltas and speech
        decisions that arrived so far, in order, without waiting, up to and including
        the first `SpeechDecision`: what the decision makes the shell do (a barge-in's
        cancel) happens before the events queued behind it are taken. A `cancel`'s
        `ResponseDone` is here as soon as `cancel` returns, so the shell can finish the
        response in the same step that decided the cancel."""

    async def wait_events(self) -> bool:
        """Wait until `take_events` has something; False once the session is closed and
        nothing more will come."""

    async def close(self) -> None:
        """Abort everything and release the session; idempotent."""


class Backend(Protocol):
    def open_session(self, session_id: str) -> BackendSession:
        """A session for one connection."""

    def pending(self) -> dict[str, int]:
        """Engine requests in flight per stage (for /metrics)."""

    def prepared_turns(self) -> dict[str, int]:
        """Prepared responses so far, by outcome: "adopted" or "discarded" (for /metrics)."""

    def llm_tokens(self) -> dict[str, int]:
        """Tokens the LLM computed so far, by phase: "prefill" or "decode" (for /metrics;
        empty when the LLM runs elsewhere)."""

    def engine_caches(self) -> dict[str, tuple[int | None, int]]:
        """(entries, bytes) of each cache the engine keeps, by name (for /metrics; entries
        None where a cache cannot count them)."""

    async def close(self) -> None:
        """Stop the engine: every open session's work is aborted."""
