"""The model-neutral output contract between a streaming stage port and the duplex core.

A `DuplexStreamingStagePort` delivers every output of every session-owned stage request
to one sink, on the asyncio loop thread, as a `DuplexStageOutput`:

- `"transcript"`: the ASR stage's final transcript of the turn's audio (`text`);
- `"text"`: an LLM text delta (`text`);
- `"audio"`: a TTS chunk, float32 little-endian mono samples at `sample_rate`, with the
  text it speaks in `text` (one sample format from the engine to the gateway, which
  resamples and encodes it once for the client);
- `"tool_call"`: an LLM function call's arguments as they stream (`text`, a delta of the
  arguments' JSON text), with `metadata["index"]` (the call's number in the reply, from
  0) and `metadata["name"]` (the function); a call is never spoken;
- `"transcript_delta"`: words the resident stage-0 request settled on while the user
  speaks (`text`, only ever appended), with `metadata["utterance_id"]` (the utterance
  it transcribes) and, when asked, `metadata["logprobs"]` (`(token, logprob)` pairs);
- `"speech"`: a speech decision of the resident stage-0 request's detection, its fields
  in the metadata (`duplex.events.SpeechDecision.as_metadata`);
- `"done"`: the stage request finished without further payload;
- `"error"`: the stage request failed (`metadata["error"]` says why).

`session_id` names the session whose request produced the output: outputs are routed by
it, never by decoding the request id. `finished=True` marks the last output of a stage
request (any kind may carry it).
`metadata` holds usage, `finish_reason`, the error message and metrics; it is frozen.

A port may also work ahead: `prepare_turn` hands it the turn a session expects to start
next (say, while the user's silence is not yet long enough to end their turn). The port
may start that work with its outputs held back. The next submission of the session whose
turn equals the prepared one may take the work over; any other submission, or
`discard_prepared`, drops it. Nothing of a prepared turn reaches the sink unless a
submission took it over, and then only under that submission's request ids.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from duplex.contracts import (
    DuplexFence,
    DuplexStagePort,
    DuplexStageSubmission,
    _ephemeral_role,
    _resource_request_fields,
    duplex_session_id_from_request_id,
)

__all__ = [
    "OUTPUT_KINDS",
    "SAMPLE_BYTES",
    "DuplexPreparedTurn",
    "DuplexStageOutput",
    "DuplexStreamingStagePort",
    "fence_from_request_id",
    "stage_id_from_request_id",
]

OUTPUT_KINDS = frozenset(
    {"transcript", "transcript_delta", "speech", "text", "audio", "tool_call", "done", "error"}
)
SAMPLE_BYTES = 4  # audio is float32


@dataclass(frozen=True)
class DuplexStageOutput:
    """One output of one session-owned stage request (see the module docstring)."""

    session_id: str
    request_id: str
    stage_id: int
    kind: str
    text: str = ""
    audio: bytes = b""
    sample_rate: int = 0
    finished: bool = False
    metadata: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OUTPUT_KINDS:
            raise ValueError(
                f"DuplexStageOutput.kind must be one of {sorted(OUTPUT_KINDS)}, got {self.kind!r}"
            )
        if self.audio and self.sample_rate <= 0:
            raise ValueError("DuplexStageOutput with audio needs a positive sample_rate")
        if len(self.audio) % SAMPLE_BYTES:
            raise ValueError("DuplexStageOutput.audio must be whole float32 samples")
        object.__setattr__(self, "audio", bytes(self.audio))
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

    @property
    def shows_client(self) -> bool:
        """Whether the client has something to see in it: text, audio or a transcript
        (an empty one too: it says transcription finished); never an error."""
        if self.kind == "error":
            return False
        return bool(self.text or self.audio) or self.kind in ("transcript", "tool_call")

    @property
    def duration_ms(self) -> float:
        """Playback length of `audio` in milliseconds (0 without audio)."""
        if not self.audio:
            return 0.0
        return len(self.audio) / SAMPLE_BYTES / self.sample_rate * 1000.0


@dataclass(frozen=True)
class DuplexPreparedTurn:
    """A turn a session expects to start next, as `start_turn` would submit it."""

    session_id: str
    config_generation: int
    sampling_params: tuple[object, ...]
    prompt: Mapping[str, object]
    entry_stage_id: int
    final_stage_id: int


class DuplexStreamingStagePort(DuplexStagePort):
    """A stage port that pushes session-owned outputs to one sink."""

    def prepare_turn(self, turn: DuplexPreparedTurn) -> None:  # noqa: B027 - optional
        """Work ahead on `turn` (see the module docstring); a port may decline by doing
        nothing, as this default does, and every turn then runs from its submission."""

    def discard_prepared(self, session_id: str) -> None:  # noqa: B027 - optional
        """Drop the session's prepared turn, if the port holds one."""

    def append_now(self, submission: DuplexStageSubmission) -> bool:
        """Take the next append of a resident request (resumable, already submitted)
        at once, on the caller's stack, if the port can without waiting; True if it
        did. It raises as `submit` would. The default declines: every append then goes
        through `submit`, in the session's order."""
        return False

    async def input_room(self, session_id: str) -> None:  # noqa: B027 - optional
        """Return once the session's input appended so far is within the port's bound
        (audio it has not processed yet): its reader appends no more until then. A port
        that processes appends as they come returns at once, as this default does."""

    def close_session(self, session_id: str) -> None:  # noqa: B027 - optional
        """The session is over and its requests are cleaned up: free whatever else the
        port keeps for it (cached context, buffered input). Called once per session."""

    @abstractmethod
    def attach_output_sink(self, sink: Callable[[DuplexStageOutput], None]) -> None:
        """Deliver every output of every session-owned request to `sink`.

        The port calls `sink` on the asyncio loop thread, in the order each request
        produced its outputs, and never after the request was aborted or cleaned up.
        """


def fence_from_request_id(request_id: object) -> DuplexFence | None:
    """The (session id, epoch, turn) fence of an ephemeral `stage{N}-turn{T}` id.

    Returns None for a malformed id and for a resumable (`stage{N}`) one, which has no
    turn to compare.
    """
    fields = _resource_request_fields(request_id)
    parsed = None if fields is None else _ephemeral_role(fields[2])
    session_id = duplex_session_id_from_request_id(request_id)  # type: ignore[arg-type]
    if fields is None or parsed is None or session_id is None:
        return None
    return DuplexFence(session_id=session_id, epoch=fields[1], turn_id=parsed[1])


def stage_id_from_request_id(request_id: object) -> int | None:
    """The stage `N` of a well-formed `stage{N}` or `stage{N}-turn{T}` id, else None."""
    fields = _resource_request_fields(request_id)
    if fields is None:
        return None
    ephemeral = _ephemeral_role(fields[2])
    if ephemeral is not None:
        return ephemeral[0]
    role = fields[2]
    digits = role[len("stage") :]
    if role.startswith("stage") and digits.isascii() and digits.isdecimal():
        return int(digits) if str(int(digits)) == digits else None
    return None
