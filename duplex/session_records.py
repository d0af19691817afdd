"""What a `DuplexSession` keeps of the work it owns: each running turn, each stage
request it reserved, and the epoch's resident stage-0 request (rules 4 and 5 of
`duplex.session`), with where that request's outputs go."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from duplex.actions import OutputRoute, OutputRouting
from duplex.contracts import DuplexOutputAction, DuplexOutputDecision, DuplexStageRequestContext
from duplex.events import SpeechDecision, UtteranceOutput
from duplex.outputs import DuplexStageOutput
from duplex.state import TurnEvent

__all__ = [
    "END_EVENTS",
    "RESIDENT_ROLE",
    "ResidentRequest",
    "RunningTurn",
    "StageRequest",
    "consumed",
]

RESIDENT_ROLE = "stage0"  # the resident stage-0 request's role in its id (rule 4)


@dataclass(slots=True)
class StageRequest:
    stage_id: int
    turn_id: int
    finished: bool = False


@dataclass(slots=True)
class ResidentRequest:
    """The epoch's resident stage-0 request (rule 4)."""

    context: DuplexStageRequestContext
    submitted: bool = False

    @property
    def request_id(self) -> str:
        return self.context.request_id

    def route(self, out: DuplexStageOutput) -> OutputRouting:
        """Rule 5: its transcript deltas go on as `UtteranceOutput` events, its speech
        decisions as `SpeechDecision`s."""
        if out.stage_id != 0:
            return OutputRouting(OutputRoute.DROP, drop_reason="stage_mismatch")
        if out.kind == "speech":
            decision = SpeechDecision.from_metadata(out.metadata)
            if decision is not None:
                return OutputRouting(OutputRoute.FORWARD, (decision,))
        utterance_id = out.metadata.get("utterance_id")
        if out.kind == "transcript_delta" and isinstance(utterance_id, str) and out.text:
            event = UtteranceOutput(utterance_id=utterance_id, output=out)
            return OutputRouting(OutputRoute.FORWARD, (event,))
        # Anything else (a failed partial, say) concerns no one but the port.
        return OutputRouting(OutputRoute.CONSUME, decision=consumed(out))


@dataclass(slots=True)
class RunningTurn:
    turn_id: int
    final_stage_id: int
    anchor_request_id: str  # the entry stage's id; the others are its same-turn ids
    tag: str | None
    conversation: bool
    usage: Mapping[str, object] = field(default_factory=dict)
    hit_length: bool = False  # some stage stopped at its token limit

    def note(self, out: DuplexStageOutput) -> None:
        """Keep what `out` tells of the whole turn: its usage, a stop at the token limit."""
        usage = out.metadata.get("usage")
        if isinstance(usage, Mapping) and usage:
            self.usage = usage
        if out.metadata.get("finish_reason") == "length":
            self.hit_length = True


# The state-table event that ends a conversation turn with each status.
END_EVENTS = {
    "completed": TurnEvent.COMPLETE_TURN,
    "incomplete": TurnEvent.COMPLETE_TURN,
    "failed": TurnEvent.FAIL_TURN,
    "cancelled": TurnEvent.CANCEL_TURN,
}


def consumed(out: DuplexStageOutput) -> DuplexOutputDecision:
    # The session acted on the output itself (turn bookkeeping), so nothing goes on.
    return DuplexOutputDecision(
        action=DuplexOutputAction.DIRECT_RESPONSE, final_output_type=out.kind, metadata=out.metadata
    )
