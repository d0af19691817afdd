"""`DuplexSession`: one client session's turn-taking state, sans I/O.

Methods take an event (open, a committed input, barge-in, a stage output, close) and
return what must happen next as values (`duplex.actions`, `duplex.events`); the session
never awaits, never reads a clock and never calls the stage port. Its shell
(`duplex.manager`) carries the actions out in order.

Rules:

1. A turn is one response attempt. `start_turn` reserves the turn's ephemeral stage
   requests `stage{N}-turn{T}` (one per stage from the entry to the final stage) and
   submits the entry stage. Only one turn is active at a time.
2. Every turn ends exactly once (completed, failed or cancelled). Ending it aborts each
   of its requests that has not finished (exactly once), releases all of them, and
   advances `turn_id`; a cancel (barge-in or client cancel) also bumps `epoch`.
3. The fence `(epoch, turn_id)` only moves forward, so an output whose request the
   session no longer owns is either stale (older fence) or unknown, and is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
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
    DuplexOutputAction,
    DuplexOutputDecision,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    duplex_ephemeral_stage_request_id,
    duplex_same_turn_request_ids,
)
from duplex.events import SessionClosed, SessionOpened, TurnDone, TurnOutput, TurnStatus
from duplex.outputs import DuplexPreparedTurn, DuplexStageOutput, fence_from_request_id
from duplex.playback import PlaybackLedger
from duplex.state import SessionState, TurnEvent, transition

__all__ = ["DEFAULT_PLAYBACK_TURNS", "DuplexSession"]

# Truncation refers to recent items only; older playback records are forgotten.
DEFAULT_PLAYBACK_TURNS = 16


@dataclass(slots=True)
class _StageRequest:
    stage_id: int
    finished: bool = False


@dataclass(slots=True)
class _Turn:
    turn_id: int
    final_stage_id: int
    anchor_request_id: str  # the entry stage's id; the others are its same-turn ids
    usage: Mapping[str, object] = field(default_factory=dict)
    hit_length: bool = False  # some stage stopped at its token limit


class DuplexSession:
    """The state of one duplex session: fence, config, the active turn, playback."""

    def __init__(
        self,
        session_id: str,
        *,
        stage_count: int,
        sampling_defaults: Sequence[object],
        config: Mapping[str, object] | None = None,
        playback_turns: int = DEFAULT_PLAYBACK_TURNS,
    ) -> None:
        if stage_count < 1:
            raise ValueError(f"stage_count must be >= 1, got {stage_count}")
        if len(sampling_defaults) != stage_count:
            raise ValueError(
                f"sampling_defaults has {len(sampling_defaults)} entries for {stage_count} stages"
            )
        if playback_turns < 1:
            raise ValueError(f"playback_turns must be >= 1, got {playback_turns}")
        self._fence = DuplexFence(session_id)
        self._stage_count = stage_count
        self._sampling_defaults = tuple(sampling_defaults)
        self._config: Mapping[str, object] = MappingProxyType(dict(config or {}))
        self._config_generation = 0
        self._state = SessionState.CREATED
        self._turn: _Turn | None = None
        self._requests: dict[str, _StageRequest] = {}
        self._playback: OrderedDict[int, PlaybackLedger] = OrderedDict()
        self._playback_turns = playback_turns

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
        return None if self._turn is None else self._turn.turn_id

    @property
    def owned_request_ids(self) -> tuple[str, ...]:
        """Stage requests reserved and not yet released, in reservation order."""
        return tuple(self._requests)

    # -- lifecycle --------------------------------------------------------------------

    def open(self) -> list[SessionStep]:
        self._state = transition(self._state, TurnEvent.OPEN)
        return [SessionOpened(session_id=self.session_id)]

    def close(self) -> list[SessionStep]:
        """Cancel the active turn, release every owned request; idempotent."""
        if self._state is SessionState.CLOSED:
            return []
        self._state = transition(self._state, TurnEvent.CLOSE)
        steps: list[SessionStep] = []
        if self._turn is not None:
            steps += self._end_turn("cancelled", reason="session_closed")
        steps += self._release(list(self._requests))
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

    # -- turns ------------------------------------------------------------------------

    def start_turn(
        self, plan: DuplexAppendPlan, *, entry_stage_id: int, final_stage_id: int
    ) -> list[SessionStep]:
        """Reserve this turn's stage requests and submit `plan` to the entry stage.

        A text input enters at the LLM stage (skipping ASR); a text-only response ends
        at it (skipping TTS).

        Raises:
            ValueError: the stage range is not `0 <= entry <= final < stage_count`.
            DuplexStateError: a turn is already active, or the session is not open.
        """
        self._check_turn(plan, entry_stage_id, final_stage_id)
        self._state = transition(self._state, TurnEvent.START_TURN)
        contexts = [
            self._context(n, final_stage_id) for n in range(entry_stage_id, final_stage_id + 1)
        ]
        for ctx in contexts:
            self._requests[ctx.request_id] = _StageRequest(ctx.stage_id)
        self._turn = _Turn(self.turn_id, final_stage_id, contexts[0].request_id)
        self._remember_playback(self.turn_id)
        submission = DuplexStageSubmission(
            context=contexts[0], prompt=plan.prompt, already_submitted=False, resumable=False
        )
        return [*(EnsureRequest(ctx) for ctx in contexts), SubmitRequest(submission)]

    def prepare_turn(
        self, plan: DuplexAppendPlan, *, entry_stage_id: int, final_stage_id: int
    ) -> DuplexPreparedTurn:
        """The turn `start_turn(plan, ...)` would submit now, for the port to work ahead on.

        Changes nothing here: the turn exists only once `start_turn` is called.

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
        """The user started speaking: cancel the active turn (no-op when none)."""
        return self._cancel("turn_detected")

    def cancel(self) -> list[SessionStep]:
        """The client cancelled the response: cancel the active turn (no-op when none)."""
        return self._cancel("client_cancelled")

    def fail_turn(self, turn_id: int, error: str, *, reason: str = "error") -> list[SessionStep]:
        """Fail turn `turn_id` (e.g. its submission failed); no-op if it already ended."""
        if self._turn is None or self._turn.turn_id != turn_id:
            return []
        self._state = transition(self._state, TurnEvent.FAIL_TURN)
        return self._end_turn("failed", reason=reason, error=error)

    # -- stage outputs ----------------------------------------------------------------

    def route_output(self, out: DuplexStageOutput) -> OutputRouting:
        """Forward, consume or drop one stage output (see `duplex.actions.OutputRouting`)."""
        if self._state is SessionState.CLOSED:
            return OutputRouting(OutputRoute.DROP, drop_reason="closed")
        request = self._requests.get(out.request_id)
        if request is None or self._turn is None:
            return OutputRouting(OutputRoute.DROP, drop_reason=self._why_unowned(out.request_id))
        if request.stage_id != out.stage_id:
            return OutputRouting(OutputRoute.DROP, drop_reason="stage_mismatch")
        if request.finished:
            return OutputRouting(OutputRoute.DROP, drop_reason="after_finish")
        turn = self._turn
        self._note_metadata(turn, out)
        request.finished = out.finished or out.kind == "error"
        if out.kind == "error":
            return self._route_error(turn, out)
        if out.kind == "audio":
            self._playback[turn.turn_id].add(out.duration_ms, out.text)
        ends_turn = out.finished and out.stage_id == turn.final_stage_id
        tail = self._complete_turn() if ends_turn else []
        if out.text or out.audio or out.kind == "transcript":
            return OutputRouting(
                OutputRoute.FORWARD, (TurnOutput(turn_id=turn.turn_id, output=out), *tail)
            )
        return OutputRouting(OutputRoute.CONSUME, tuple(tail), decision=_decision(out))

    # -- playback ---------------------------------------------------------------------

    def heard_text(self, audio_end_ms: float, *, turn_id: int | None = None) -> str:
        """The assistant text the first `audio_end_ms` ms of turn `turn_id` spoke.

        `turn_id` defaults to the latest turn. Raises ValueError for a turn with no
        playback record (never started, or older than the last `playback_turns`).
        """
        return self._ledger(turn_id).heard_text(audio_end_ms)

    def audio_duration_ms(self, *, turn_id: int | None = None) -> float:
        """Milliseconds of audio sent to the client for turn `turn_id` (default latest)."""
        return self._ledger(turn_id).duration_ms

    # -- internals --------------------------------------------------------------------

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

    def _cancel(self, reason: str) -> list[SessionStep]:
        self._state = transition(self._state, TurnEvent.CANCEL_TURN)
        if self._turn is None:
            return []
        # The epoch bump makes every in-flight output of the turn stale at once.
        self._fence = replace(self._fence, epoch=self._fence.epoch + 1)
        return self._end_turn("cancelled", reason=reason)

    def _complete_turn(self) -> list[SessionStep]:
        assert self._turn is not None
        self._state = transition(self._state, TurnEvent.COMPLETE_TURN)
        if self._turn.hit_length:
            return self._end_turn("incomplete", reason="max_output_tokens")
        return self._end_turn("completed")

    def _route_error(self, turn: _Turn, out: DuplexStageOutput) -> OutputRouting:
        message = out.metadata.get("error") or out.text or "stage request failed"
        self._state = transition(self._state, TurnEvent.FAIL_TURN)
        steps = self._end_turn("failed", reason="error", error=f"stage {out.stage_id}: {message}")
        return OutputRouting(OutputRoute.CONSUME, tuple(steps), decision=_decision(out))

    def _end_turn(
        self, status: TurnStatus, *, reason: str | None = None, error: str | None = None
    ) -> list[SessionStep]:
        turn, self._turn = self._turn, None
        assert turn is not None
        anchor = turn.anchor_request_id
        steps = self._release([anchor, *duplex_same_turn_request_ids(anchor, self._requests)])
        self._fence = replace(self._fence, turn_id=turn.turn_id + 1)
        done = TurnDone(
            turn_id=turn.turn_id, status=status, reason=reason, usage=turn.usage, error=error
        )
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
        fence = fence_from_request_id(request_id)
        if fence is None or fence.session_id != self.session_id:
            return "unknown_request"
        older = (fence.epoch, fence.turn_id) < (self.epoch, self.turn_id)
        return "stale" if older else "unknown_request"

    def _note_metadata(self, turn: _Turn, out: DuplexStageOutput) -> None:
        usage = out.metadata.get("usage")
        if isinstance(usage, Mapping) and usage:
            turn.usage = usage
        if out.metadata.get("finish_reason") == "length":
            turn.hit_length = True

    def _remember_playback(self, turn_id: int) -> None:
        self._playback[turn_id] = PlaybackLedger()
        while len(self._playback) > self._playback_turns:
            self._playback.popitem(last=False)

    def _ledger(self, turn_id: int | None) -> PlaybackLedger:
        if turn_id is None and self._playback:
            turn_id = next(reversed(self._playback))
        ledger = self._playback.get(turn_id) if turn_id is not None else None
        if ledger is None:
            raise ValueError(
                f"no playback record for turn {turn_id} (kept: the last {self._playback_turns})"
            )
        return ledger


def _decision(out: DuplexStageOutput) -> DuplexOutputDecision:
    # The session acted on the output itself (turn bookkeeping), so nothing goes on.
    return DuplexOutputDecision(
        action=DuplexOutputAction.DIRECT_RESPONSE, final_output_type=out.kind, metadata=out.metadata
    )
