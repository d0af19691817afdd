"""What the sans-I/O realtime session asks its shell (`gateway.server.connection`) to do.

`RealtimeSession.actions()` returns these in the order they were decided; the shell
carries each one out in that order against the backend, the speech source or the socket.
"""

from __future__ import annotations

from dataclasses import dataclass

from duplex.turn import TurnRequest
from gateway.protocol.audio import Samples
from gateway.protocol.session_config import LiveTranscription, TurnDetection

__all__ = [
    "Action",
    "CancelResponse",
    "CloseSession",
    "ConfigureVad",
    "DiscardPrepared",
    "EndUtterance",
    "Hear",
    "Listen",
    "PrepareResponse",
    "StartResponse",
    "StartUtterance",
]


@dataclass(frozen=True)
class StartResponse:
    """Run `turn` under `response_id` (a response, or a transcription job's id).
    `conversation` is False for turns beside the conversation's (out-of-band responses,
    transcriptions)."""

    response_id: str
    turn: TurnRequest
    conversation: bool


@dataclass(frozen=True)
class PrepareResponse:
    """Start the work of the conversation turn a pause in speech would get if it became
    a stop; the `StartResponse` of an equal turn takes the work over."""

    turn: TurnRequest


@dataclass(frozen=True)
class DiscardPrepared:
    """The prepared turn will not be asked for: stop its work."""


@dataclass(frozen=True)
class CancelResponse:
    """End a turn's engine work; `reason` "turn_detected" is a barge-in. The response is
    finished when the backend reports its `ResponseDone`."""

    response_id: str
    reason: str


@dataclass(frozen=True)
class Hear:
    """The session's next input samples, float32 at 16 kHz (the ones VAD gets), for the
    backend's live transcription: every sample once, in order."""

    samples: Samples


@dataclass(frozen=True)
class StartUtterance:
    """Speech began at `start_ms`: transcribe it live as `item_id` while listening."""

    item_id: str
    start_ms: float


@dataclass(frozen=True)
class EndUtterance:
    """No more live work for `item_id`: it was committed (its turn names it and
    finishes the transcript) or dropped."""

    item_id: str


@dataclass(frozen=True)
class Listen:
    """Transcribe speech live with `options` from now on; None: not at all."""

    options: LiveTranscription | None


@dataclass(frozen=True)
class ConfigureVad:
    """(Re)start server VAD from session time `start_ms`, or stop it (`settings` None)."""

    settings: TurnDetection | None
    start_ms: float
    pause_after_ms: int | None = None


@dataclass(frozen=True)
class WatchWords:
    """The speech under way started over a running response: have its words checked, so
    that more than a backchannel confirms it as an interruption early. `again`: it was
    confirmed, but what confirmed it was the answer's own echo; it is a candidate again,
    confirmed afresh by its length or its words from now on."""

    again: bool = False


@dataclass(frozen=True)
class ClearOutputAudio:
    """A WebRTC call's client sent `output_audio_buffer.clear`: stop the audio its track
    still has to play, and truncate the item there."""


@dataclass(frozen=True)
class CloseSession:
    code: int
    reason: str


Action = (
    StartResponse
    | PrepareResponse
    | DiscardPrepared
    | CancelResponse
    | Hear
    | StartUtterance
    | EndUtterance
    | Listen
    | ConfigureVad
    | WatchWords
    | ClearOutputAudio
    | CloseSession
)
