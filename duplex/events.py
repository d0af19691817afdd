"""Session events: what the gateway reads from `DuplexSessionHandle.events()`.

Every session yields, in order:

- `SessionOpened` once, first;
- for each turn (one turn = one response attempt, numbered by `turn_id`):
  any number of `TurnOutput` (a stage output to send to the client, e.g. the user's
  transcript, LLM text deltas, TTS audio chunks), then exactly one `TurnDone`. The
  conversation's turns come one at a time; side turns (see `duplex.session`) may
  interleave with them;
- at any time, `UtteranceOutput`: a live transcript delta of the utterance the user is
  speaking, from the epoch's resident stage-0 request (see `duplex.session` rule 5);
- at any time, `SpeechDecision`: what the resident request's speech detection decided
  (speech started, paused, resumed, confirmed or stopped), at session time `ms`;
- `SessionClosed` once, last; the iterator ends after it.

No `TurnOutput` of a turn ever follows that turn's `TurnDone`: outputs still in flight
when a turn ends (barge-in, cancel, failure) are dropped inside the session core, and
so are its outputs still waiting in the reader's queue.

`TurnDone.status` and `reason`:

| status | reason | when |
|---|---|---|
| `"completed"` | `None` | the final stage's request finished |
| `"incomplete"` | `"max_output_tokens"` | it finished, but the LLM stopped at `max_tokens` |
| `"cancelled"` | `"turn_detected"` | `barge_in()`: the user started speaking |
| `"cancelled"` | `"client_cancelled"` | `cancel()`: the client cancelled the response |
| `"cancelled"` | `"superseded"` | `cancel(reason="superseded")`: another turn does its work |
| `"cancelled"` | `"session_closed"` | the session closed while the turn was active |
| `"failed"` | `"error"` | a stage request failed, or its submission did; see `error` |
| `"failed"` | `"backpressure"` | the event consumer fell too far behind; see `error` |
| `"failed"` | `"rejected"` | the turn could not start (`reject_turn`); see `error` |

A `"failed"` turn refused for what it asked (a limit of the engine, say) also has
`error_code`, the stage's name for the refusal, which the client can act on.

`tag` is the caller's name for the turn (the gateway's response id), given to
`start_turn` and carried unchanged on every `TurnOutput` and the `TurnDone`.

`usage` is the `usage` mapping the turn's stage outputs last reported (the LLM stage
reports OpenAI-shaped token counts), empty if none did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from duplex.outputs import DuplexStageOutput

__all__ = [
    "CANCEL_REASONS",
    "DuplexEvent",
    "SessionClosed",
    "SessionOpened",
    "SpeechDecision",
    "SpeechKind",
    "TurnDone",
    "TurnOutput",
    "TurnStatus",
    "UtteranceOutput",
]

TurnStatus = Literal["completed", "incomplete", "cancelled", "failed"]
SpeechKind = Literal["started", "stopped", "paused", "resumed", "confirmed"]
SPEECH_KINDS: frozenset[str] = frozenset(("started", "stopped", "paused", "resumed", "confirmed"))
CANCEL_REASONS = frozenset({"turn_detected", "client_cancelled", "superseded", "session_closed"})
_STATUSES = frozenset({"completed", "incomplete", "cancelled", "failed"})


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionOpened:
    session_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnOutput:
    """One stage output of turn `turn_id` that the client should see."""

    turn_id: int
    output: DuplexStageOutput
    tag: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnDone:
    """The one terminal event of turn `turn_id` (see the module table)."""

    turn_id: int
    status: TurnStatus
    reason: str | None = None
    usage: Mapping[str, object] = field(default_factory=dict)
    error: str | None = None
    error_code: str | None = None
    tag: str | None = None

    def __post_init__(self) -> None:
        if self.status not in _STATUSES:
            raise ValueError(f"TurnDone.status must be one of {sorted(_STATUSES)}")
        if self.status == "cancelled" and self.reason not in CANCEL_REASONS:
            raise ValueError(f"a cancelled TurnDone needs a reason in {sorted(CANCEL_REASONS)}")
        if self.status == "failed" and not self.error:
            raise ValueError("a failed TurnDone needs an error message")
        object.__setattr__(self, "usage", MappingProxyType(dict(self.usage)))


@dataclass(frozen=True, slots=True, kw_only=True)
class UtteranceOutput:
    """One output of the resident stage-0 request about utterance `utterance_id`
    (kind `"transcript_delta"`)."""

    utterance_id: str
    output: DuplexStageOutput


@dataclass(frozen=True, slots=True)
class SpeechDecision:
    """Speech `started` or `stopped` at session time `ms`; `paused` (the silence that
    began at `ms` may become a stop) and `resumed` (it did not); `confirmed` (the speech
    that started at `ms` has lasted long enough, or said enough, to interrupt). A
    `paused` decision may carry the `words` heard in the speech before the silence: they
    only go up (for the caller to see); the engine keeps them, and the turn that ends at
    that silence reports them as its transcript rather than transcribing it again. A
    `confirmed` decision carries the `words` that confirmed it (None: its length did).

    The resident request reports one as a stage output of kind `"speech"`, its fields
    in the metadata (`as_metadata`, `from_metadata`)."""

    kind: SpeechKind
    ms: float
    words: str | None = None

    def as_metadata(self) -> dict[str, object]:
        return {"speech": self.kind, "ms": self.ms, "words": self.words}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, object]) -> SpeechDecision | None:
        """The decision `metadata` holds; None if it holds none."""
        kind, ms, words = metadata.get("speech"), metadata.get("ms"), metadata.get("words")
        if kind not in SPEECH_KINDS or not isinstance(ms, (int, float)) or isinstance(ms, bool):
            return None
        if words is not None and not isinstance(words, str):
            return None
        return cls(kind, float(ms), words)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionClosed:
    session_id: str


DuplexEvent = (
    SessionOpened | TurnOutput | UtteranceOutput | SpeechDecision | TurnDone | SessionClosed
)
