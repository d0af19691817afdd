"""`DuplexSession`: one client session's turn-taking state, sans I/O.

Methods take an event (open, a turn to start, barge-in, a stage output, close) and
return what must happen next as values (`duplex.actions`, `duplex.events`); the session
never awaits, never reads a clock and never calls the stage port. Its shell
(`duplex.manager`) carries the actions out in order.

Rules:

1. A turn is one response attempt, named by the caller's `tag`. `start_turn` reserves
   the turn's ephemeral stage requests `stage{N}-turn{T}` (one per stage from the entry
   to the final stage) and submits the entry stage. The conversation's turn is one at a
   time, and it is the one a barge-in cancels; side turns (`conversation=False`: a
   response outside the conversation, a transcription) run beside it.
2. Every turn ends exactly once (completed, failed or cancelled). Ending it aborts each
   of its requests that has not finished (exactly once) and releases all of them;
   cancelling the conversation's turn also bumps `epoch`.
3. `turn_id` counts the turns started; the fence `(epoch, turn_id)` only moves forward,
   so an output whose request the session no longer owns is either stale (older fence)
   or unknown, and is dropped. This is the one place stale output is filtered.
4. The session's input as it happens (the audio heard, utterance starts and ends, the
   live-transcription options: `duplex.appends`) goes to ONE resident stage-0 request
   per epoch, `...e.{epoch}.r.stage0`, as `append` plans: the epoch's first append
   reserves it (`EnsureRequest`) and submits with `already_submitted=False`, every later
   one with `already_submitted=True`; all with `resumable=True`. Each prompt is one
   append, keyed by `"append"`: `"heard"` (`audio`: float32 16 kHz bytes),
   `"utterance_started"` (`utterance_id`, `start_ms`), `"utterance_ended"`
   (`utterance_id`) or `"listen"` (`enabled`, `prompt`, `logprobs`). The port keeps
   what the request heard; turns (rule 1) stay ephemeral and may name the utterance.
5. An epoch bump (cancelling the conversation's turn) reserves the new epoch's resident
   request, then aborts and releases the old one: its outputs in flight are stale. The
   new one is submitted with the next append. Closing aborts the resident request.
   Its `transcript_delta` outputs of the current epoch become `UtteranceOutput`
   events; any of an older epoch are dropped as stale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from duplex.actions import (
    AbortRequests,
    CleanupRequests,
    EnsureRequest,
    OutputRoute,
    OutputRouting,
    SessionStep,
    SubmitRequest,
)
from duplex.contracts import (
    DuplexAppendPlan,
    DuplexFence,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    _resource_request_fields,
    duplex_ephemeral_stage_request_id,
    duplex_resource_request_id,
    duplex_same_turn_request_ids,
)
from duplex.errors import DuplexStateError
from duplex.events import (
    CANCEL_REASONS,
    SessionClosed,
    SessionOpened,
    TurnDone,
    TurnOutput,
    TurnStatus,
)
from duplex.outputs import DuplexPreparedTurn, DuplexStageOutput, fence_from_request_id
from duplex.session_records import (
    END_EVENTS,
    RESIDENT_ROLE,
    ResidentRequest,
    RunningTurn,
    StageRequest,
    consumed,
)
from duplex.state import SessionState, TurnEvent, transition

__all__ = ["DuplexSession", "RESIDENT_ROLE"]


class DuplexSession:
    """The state of one duplex session: fence, config, its running turns."""

    def __init__(
        self,
        session_id: str,
        *,
        stage_count: int,
        sampling_defaults: Sequence[object],
        config: Mapping[str, object] | None = None,
    ) -> None:
        if stage_count < 1:
            raise ValueError(f"stage_count must be >= 1, got {stage_count}")
        if len(sampling_defaults) != stage_count:
            raise ValueError(
                f"sampling_defaults has {len(sampling_defaults)} entries for {stage_count} stages"
            )
        self._fence = DuplexFence(session_id)
        self._stage_count = stage_count
        self._sampling_defaults = tuple(sampling_defaults)
        self._config: Mapping[str, object] = MappingProxyType(dict(config or {}))
        self._config_generation = 0
        self._state = SessionState.CREATED
        self._turns: dict[int, RunningTurn] = {}
        self._conversation_turn: int | None = None
        self._requests: dict[str, StageRequest] = {}
        self._resident: ResidentRequest | None = None

    # -- read-only views --------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._fence.session_id

    @property
    def fence(self) -> DuplexFence:
        return self._fence

    @property
    def epoch(self) -> int:
        return self._fence.epoch

    @property
    def turn_id(self) -> int:
        """The id the next turn will get."""
        return self._fence.turn_id

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def stage_count(self) -> int:
        return self._stage_count

    @property
    def config(self) -> Mapping[str, object]:
        return self._config

    @property
    def config_generation(self) -> int:
        return self._config_generation

    @property
    def active_turn_id(self) -> int | None:
        """The conversation's running turn, if any."""
        return self._conversation_turn

    @property
    def running_turn_ids(self) -> tuple[int, ...]:
        """Every running turn, the conversation's and the side turns, oldest first."""
        return tuple(self._turns)

    @property
    def owned_request_ids(self) -> tuple[str, ...]:
        """Stage requests reserved and not yet released: the turns' in reservation
        order, then the resident stage-0 request (rule 4), if reserved."""
        resident = () if self._resident is None else (self._resident.request_id,)
        return (*self._requests, *resident)

    @property
    def resident_request_id(self) -> str | None:
        """The current epoch's resident stage-0 request, once reserved (rule 4)."""
        return None if self._resident is None else self._resident.request_id

    def turn_of(self, request_id: str) -> int | None:
        """The running turn that owns `request_id`, if any."""
        request = self._requests.get(request_id)
        return None if request is None else request.turn_id

    # -- lifecycle --------------------------------------------------------------------

    def open(self) -> list[SessionStep]:
        self._state = transition(self._state, TurnEvent.OPEN)
        return [SessionOpened(session_id=self.session_id)]

    def close(self) -> list[SessionStep]:
        """Cancel every running turn, release every owned request; idempotent."""
        if self._state is SessionState.CLOSED:
            return []
        self._state = transition(self._state, TurnEvent.CLOSE)
        steps: list[SessionStep] = []
        for turn in list(self._turns.values()):
            steps += self._end_turn(turn, "cancelled", reason="session_closed")
        steps += self._release(list(self._requests))
        steps += self._release_resident()
        steps.append(SessionClosed(session_id=self.session_id))
        return steps

    def update_config(self, config: Mapping[str, object]) -> int:
        """Replace the config for turns started from now on; returns the new generation."""
        if not isinstance(config, Mapping):
            raise ValueError(f"session config must be a mapping, got {config!r}")
        self._state = transition(self._state, TurnEvent.UPDATE_CONFIG)
        self._config = MappingProxyType(dict(config))
        self._config_generation += 1
        return self._config_generation

    # -- the resident stage-0 request (rules 4 and 5) ----------------------------------

    def append(self, plan: DuplexAppendPlan) -> list[SessionStep]:
        """Submit `plan` (see `duplex.appends`) to the epoch's resident stage-0 request,
        reserving it first if this is the epoch's first append.

        Raises:
            ValueError: `plan` is not a `DuplexAppendPlan`.
            DuplexStateError: the session is not open.
        """
        if not isinstance(plan, DuplexAppendPlan):
            raise ValueError(f"an append needs a DuplexAppendPlan, got {type(plan).__name__}")
        if self._state is not SessionState.IDLE and self._state is not SessionState.RESPONDING:
            raise DuplexStateError(f"duplex session can't append in state {self._state.value}")
        steps: list[SessionStep] = []
        if self._resident is None:
            steps += self._reserve_resident()
        resident = self._resident
        assert resident is not None
        submission = DuplexStageSubmission(
            context=resident.context,
            prompt=plan.prompt,
            already_submitted=resident.submitted,
            resumable=True,
        )
        resident.submitted = True
        steps.append(SubmitRequest(submission))
        return steps

    def _reserve_resident(self) -> list[SessionStep]:
        context = DuplexStageRequestContext(
            request_id=duplex_resource_request_id(self._fence, RESIDENT_ROLE),
            session_id=self.session_id,
            fence=self._fence,
            stage_id=0,
            final_stage_id=0,
            config_generation=self._config_generation,
            sampling_params=self._sampling_defaults,
            session_config=self._config,
        )
        self._resident = ResidentRequest(context)
        return [EnsureRequest(context)]

    def _renew_resident(self) -> list[SessionStep]:
        """Rule 5: after an epoch bump, the new epoch's resident request is reserved
        before the old one is let go, so the port never sees the session without one."""
        if self._resident is None:
            return []
        old = self._resident
        steps = self._reserve_resident()
        return [*steps, AbortRequests((old.request_id,)), CleanupRequests((old.request_id,))]

    def _release_resident(self) -> list[SessionStep]:
        if self._resident is None:
            return []
        rid, self._resident = self._resident.request_id, None
        return [AbortRequests((rid,)), CleanupRequests((rid,))]

    # -- turns ------------------------------------------------------------------------

    def start_turn(
        self,
        plan: DuplexAppendPlan,
        *,
        entry_stage_id: int,
        final_stage_id: int,
        tag: str | None = None,
        conversation: bool = True,
    ) -> list[SessionStep]:
        """Reserve a new turn's stage requests and submit `plan` to the entry stage; the
        turn's id is `turn_id` as it was before the call.

        A text input enters at the LLM stage (skipping ASR); a text-only response ends
        at it (skipping TTS).

        Raises:
            ValueError: the stage range is not `0 <= entry <= final < stage_count`.
            DuplexStateError: the conversation already has a running turn (for a
                conversation turn), or the session is not open.
        """
        self._check_turn(plan, entry_stage_id, final_stage_id)
        event = TurnEvent.START_TURN if conversation else TurnEvent.START_SIDE_TURN
        self._state = transition(self._state, event)
        # The requests are named under the fence before it moves on: `stage{N}-turn{T}`
        # with T this turn's id.
        contexts = [
            self._context(n, final_stage_id) for n in range(entry_stage_id, final_stage_id + 1)
        ]
        turn_id = self._next_turn_id()
        for ctx in contexts:
            self._requests[ctx.request_id] = StageRequest(ctx.stage_id, turn_id)
        turn = RunningTurn(turn_id, final_stage_id, contexts[0].request_id, tag, conversation)
        self._turns[turn_id] = turn
        if conversation:
            self._conversation_turn = turn_id
        submission = DuplexStageSubmission(
            context=contexts[0], prompt=plan.prompt, already_submitted=False, resumable=False
        )
        return [*(EnsureRequest(ctx) for ctx in contexts), SubmitRequest(submission)]

    def reject_turn(self, tag: str | None, error: str) -> list[SessionStep]:
        """A turn the caller could not start: it gets an id and ends failed at once, so
        whoever waits for its `TurnDone` gets one. Nothing once the session is closed:
        `SessionClosed` is its last event."""
        if self._state is SessionState.CLOSED:
            return []
        done = TurnDone(
            turn_id=self._fence.turn_id, status="failed", reason="rejected", error=error, tag=tag
        )
        self._next_turn_id()
        return [done]

    def prepare_turn(
        self, plan: DuplexAppendPlan, *, entry_stage_id: int, final_stage_id: int
    ) -> DuplexPreparedTurn:
        """The conversation turn `start_turn(plan, ...)` would submit now, for the port to
        work ahead on. Changes nothing here: the turn exists only once `start_turn` is
        called.

        Raises: as `start_turn`.
        """
        self._check_turn(plan, entry_stage_id, final_stage_id)
        transition(self._state, TurnEvent.START_TURN)  # raises unless a turn could start
        return DuplexPreparedTurn(
            session_id=self.session_id,
            config_generation=self._config_generation,
            sampling_params=self._sampling_defaults,
            prompt=plan.prompt,
            entry_stage_id=entry_stage_id,
            final_stage_id=final_stage_id,
        )

    def _check_turn(self, plan: DuplexAppendPlan, entry_stage_id: int, final_stage_id: int) -> None:
        if not isinstance(plan, DuplexAppendPlan):
            raise ValueError(f"a turn needs a DuplexAppendPlan, got {type(plan).__name__}")
        if not 0 <= entry_stage_id <= final_stage_id < self._stage_count:
            raise ValueError(
                f"stages must satisfy 0 <= entry ({entry_stage_id}) <= final "
                f"({final_stage_id}) < stage_count ({self._stage_count})"
            )

    def barge_in(self) -> list[SessionStep]:
        """The user started speaking: cancel the conversation's turn (no-op when none)."""
        return self.cancel(reason="turn_detected")

    def cancel(
        self, *, tag: str | None = None, reason: str = "client_cancelled"
    ) -> list[SessionStep]:
        """Cancel the turn named `tag`, or the conversation's turn when `tag` is None;
        a no-op when no such turn is running.

        Raises:
            ValueError: `reason` is not one of `duplex.events.CANCEL_REASONS`.
        """
        if reason not in CANCEL_REASONS:
            raise ValueError(f"cancel reason must be one of {sorted(CANCEL_REASONS)}: {reason!r}")
        turn = self._find(tag)
        if turn is None:
            transition(self._state, TurnEvent.CANCEL_TURN)  # raises in a state that can't
            return []
        if not turn.conversation:
            return self._end_turn(turn, "cancelled", reason=reason)
        # The epoch bump makes every in-flight output of the turn stale at once.
        self._fence = replace(self._fence, epoch=self._fence.epoch + 1)
        renew = self._renew_resident()
        return [*renew[:1], *self._end_turn(turn, "cancelled", reason=reason), *renew[1:]]

    def fail_turn(self, turn_id: int, error: str, *, reason: str = "error") -> list[SessionStep]:
        """Fail turn `turn_id` (e.g. its submission failed); no-op if it already ended."""
        turn = self._turns.get(turn_id)
        if turn is None:
            return []
        return self._end_turn(turn, "failed", reason=reason, error=error)

    # -- stage outputs ----------------------------------------------------------------

    def route_output(self, out: DuplexStageOutput) -> OutputRouting:
        """Forward, consume or drop one stage output (see `duplex.actions.OutputRouting`)."""
        if self._state is SessionState.CLOSED:
            return OutputRouting(OutputRoute.DROP, drop_reason="closed")
        if self._resident is not None and out.request_id == self._resident.request_id:
            return self._resident.route(out)
        request = self._requests.get(out.request_id)
        if request is None:
            return OutputRouting(OutputRoute.DROP, drop_reason=self._why_unowned(out.request_id))
        if request.stage_id != out.stage_id:
            return OutputRouting(OutputRoute.DROP, drop_reason="stage_mismatch")
        if request.finished:
            return OutputRouting(OutputRoute.DROP, drop_reason="after_finish")
        turn = self._turns[request.turn_id]
        turn.note(out)
        request.finished = out.finished or out.kind == "error"
        if out.kind == "error":
            message = str(out.metadata.get("error") or out.text or "stage request failed")
            code = out.metadata.get("error_code")
            if not isinstance(code, str):  # a fault: say where it happened
                code, message = None, f"stage {out.stage_id}: {message}"
            steps = self._end_turn(turn, "failed", reason="error", error=message, error_code=code)
            return OutputRouting(OutputRoute.CONSUME, tuple(steps), decision=consumed(out))
        ends_turn = out.finished and out.stage_id == turn.final_stage_id
        tail = self._complete_turn(turn) if ends_turn else []
        if out.shows_client:
            forward = TurnOutput(turn_id=turn.turn_id, output=out, tag=turn.tag)
            return OutputRouting(OutputRoute.FORWARD, (forward, *tail))
        return OutputRouting(OutputRoute.CONSUME, tuple(tail), decision=consumed(out))

    # -- internals --------------------------------------------------------------------

    def _next_turn_id(self) -> int:
        turn_id = self._fence.turn_id
        self._fence = replace(self._fence, turn_id=turn_id + 1)
        return turn_id

    def _find(self, tag: str | None) -> RunningTurn | None:
        if tag is None:
            return None if self._conversation_turn is None else self._turns[self._conversation_turn]
        return next((t for t in self._turns.values() if t.tag == tag), None)

    def _context(self, stage_id: int, final_stage_id: int) -> DuplexStageRequestContext:
        return DuplexStageRequestContext(
            request_id=duplex_ephemeral_stage_request_id(self._fence, stage_id=stage_id),
            session_id=self.session_id,
            fence=self._fence,
            stage_id=stage_id,
            final_stage_id=final_stage_id,
            config_generation=self._config_generation,
            sampling_params=self._sampling_defaults,
            session_config=self._config,
        )

    def _complete_turn(self, turn: RunningTurn) -> list[SessionStep]:
        if turn.hit_length:
            return self._end_turn(turn, "incomplete", reason="max_output_tokens")
        return self._end_turn(turn, "completed")

    def _end_turn(
        self,
        turn: RunningTurn,
        status: TurnStatus,
        *,
        reason: str | None = None,
        error: str | None = None,
        error_code: str | None = None,
    ) -> list[SessionStep]:
        # Built first: an invalid reason or a missing error raises before anything changed.
        done = TurnDone(
            turn_id=turn.turn_id,
            status=status,
            reason=reason,
            usage=turn.usage,
            error=error,
            error_code=error_code,
            tag=turn.tag,
        )
        del self._turns[turn.turn_id]
        if turn.conversation:
            self._conversation_turn = None
            if self._state is SessionState.RESPONDING:  # not when closing
                self._state = transition(self._state, END_EVENTS[status])
        anchor = turn.anchor_request_id
        steps = self._release([anchor, *duplex_same_turn_request_ids(anchor, self._requests)])
        return [*steps, done]

    def _release(self, request_ids: list[str]) -> list[SessionStep]:
        """Abort the unfinished ones among `request_ids`, then clean up all of them."""
        if not request_ids:
            return []
        released = [(rid, self._requests.pop(rid)) for rid in request_ids]
        running = tuple(rid for rid, req in released if not req.finished)
        cleanup = CleanupRequests(tuple(rid for rid, _ in released))
        return [AbortRequests(running), cleanup] if running else [cleanup]

    def _why_unowned(self, request_id: str) -> str:
        fields = _resource_request_fields(request_id)
        if fields is not None and fields[2] == RESIDENT_ROLE:
            mine = duplex_resource_request_id(replace(self._fence, epoch=fields[1]), RESIDENT_ROLE)
            return "stale" if mine == request_id and fields[1] < self.epoch else "unknown_request"
        fence = fence_from_request_id(request_id)
        if fence is None or fence.session_id != self.session_id:
            return "unknown_request"
        older = (fence.epoch, fence.turn_id) < (self.epoch, self.turn_id)
        return "stale" if older else "unknown_request"
