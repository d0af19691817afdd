"""One open duplex session's asyncio shell: its commands, its event queue and the
worker that carries out its port calls in order (the manager's half for one session;
see `duplex.manager`).

Commands (`start_turn`, `append`, `barge_in`, `cancel`) are synchronous: the session
decides at once, its events are queued at once, and the port calls they need run in
order on the session's one worker task (`settled()` waits for them). So a barge-in's
`TurnDone` reaches the reader before any later event, and a turn started after a cancel
runs after it. The worker lives as long as the session; an append to the resident
request goes to the port at once (`append_now`) while the worker has nothing waiting,
so a frame costs neither a task nor a wake-up.

A turn that ends early (cancel, failure) takes its outputs still waiting in the queue
with it: the reader never sees an output of a turn after that turn was cancelled.

Backpressure: the event queue holds at most `max_events` outputs (terminal events
always fit). When it is full, the turn of the next output the client would see fails
with reason `"backpressure"` (its requests are aborted: producing audio nobody reads
only adds latency) and `start_turn` raises `DuplexBackpressureError` until the reader
catches up.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING

from duplex.actions import (
    AbortRequests,
    Action,
    CleanupRequests,
    EnsureRequest,
    OutputRoute,
    SessionStep,
    SubmitRequest,
)
from duplex.appends import Append
from duplex.contracts import DuplexFence
from duplex.errors import (
    DuplexBackpressureError,
    DuplexStateError,
)
from duplex.events import (
    DuplexEvent,
    SessionClosed,
    SessionOpened,
    SpeechDecision,
    TurnDone,
    TurnOutput,
    UtteranceOutput,
)
from duplex.outputs import DuplexStageOutput
from duplex.session import DuplexSession
from duplex.state import SessionState
from duplex.turn import TurnRequest

if TYPE_CHECKING:
    from duplex.manager import DuplexSessionManager

__all__ = ["DuplexSessionHandle"]

logger = logging.getLogger(__name__)

_EVENT_TYPES = (
    SessionOpened,
    TurnOutput,
    UtteranceOutput,
    SpeechDecision,
    TurnDone,
    SessionClosed,
)


class DuplexSessionHandle:
    """One open session: the gateway's way to drive it and to read its events."""

    def __init__(
        self, manager: DuplexSessionManager, session: DuplexSession, *, max_events: int
    ) -> None:
        self._manager = manager
        self._session = session
        self._max_events = max_events
        self._queue: collections.deque[DuplexEvent] = collections.deque()
        self._outputs_queued = 0
        self._ready = asyncio.Event()
        # Port calls decided and not yet carried out, one batch per decision, run in
        # order by `_worker` (started by the first batch, ended by close).
        self._work: collections.deque[list[Action]] = collections.deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._worker: asyncio.Task[None] | None = None
        self._stopping = False
        self._close_task: asyncio.Future[None] | None = None
        self._consuming = False
        self._events_ended = False

    # -- views ------------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._session.session_id

    @property
    def fence(self) -> DuplexFence:
        return self._session.fence

    @property
    def epoch(self) -> int:
        return self._session.epoch

    @property
    def turn_id(self) -> int:
        return self._session.turn_id

    @property
    def active_turn_id(self) -> int | None:
        return self._session.active_turn_id

    @property
    def running_turn_ids(self) -> tuple[int, ...]:
        return self._session.running_turn_ids

    @property
    def config(self) -> Mapping[str, object]:
        return self._session.config

    @property
    def config_generation(self) -> int:
        return self._session.config_generation

    @property
    def owned_request_ids(self) -> tuple[str, ...]:
        return self._session.owned_request_ids

    @property
    def closed(self) -> bool:
        return self._session.state is SessionState.CLOSED

    # -- commands ---------------------------------------------------------------------

    def start_turn(
        self, turn: TurnRequest, *, tag: str | None = None, conversation: bool = True
    ) -> int:
        """Start `turn` as a new turn named `tag`, through the stages its fields call for
        (`TurnRequest.entry` to `.final`; see `DuplexSession.start_turn`); returns its
        `turn_id`. Its outputs and its one `TurnDone` arrive through `events()`; a failed
        submission ends the turn with a failed `TurnDone`.

        Raises:
            DuplexStateError: the conversation has a running turn, or the session is closed.
            DuplexBackpressureError: the event queue is full.
            ValueError: the turn's stages are beyond the port's.
        """
        if self._outputs_queued >= self._max_events and not self.closed:
            raise DuplexBackpressureError(
                f"session {self.session_id}: {self._outputs_queued} events are waiting unread"
            )
        turn_id = self._session.turn_id
        self._spawn(
            self._session.start_turn(
                turn.plan(),
                entry_stage_id=turn.entry,
                final_stage_id=turn.final,
                tag=tag,
                conversation=conversation,
            )
        )
        return turn_id

    def reject_turn(self, tag: str | None, error: str) -> None:
        """End a turn that could not start with a failed `TurnDone`, in queue order."""
        self._deliver(self._session.reject_turn(tag, error))

    def prepare_turn(self, turn: TurnRequest) -> None:
        """Let the port work ahead on the conversation turn `start_turn(turn)` would
        start; the outputs appear only if that turn is then started.

        Raises: as `start_turn` (ValueError, DuplexStateError), without changing anything.
        """
        prepared = self._session.prepare_turn(
            turn.plan(), entry_stage_id=turn.entry, final_stage_id=turn.final
        )
        self._manager.port.prepare_turn(prepared)

    def discard_prepared(self) -> None:
        """Stop work the port did ahead for this session, if any."""
        self._manager.port.discard_prepared(self.session_id)

    def append(self, value: Append) -> None:
        """Submit `value` to the session's resident stage-0 request, as its plan (see
        `duplex.appends` and `DuplexSession.append`).

        Raises: as `DuplexSession.append` (ValueError, DuplexStateError).
        """
        steps = self._session.append(value.plan())
        if not self._append_now(steps):
            self._spawn(steps)

    def _append_now(self, steps: list[SessionStep]) -> bool:
        """Hand an append to a resident request already submitted straight to the port
        (`append_now`) while nothing decided before it waits for the worker, so the
        order holds and a frame costs no wake-up of the worker; False: not taken."""
        if len(steps) != 1 or not self._idle.is_set() or self._stopping:
            return False
        (step,) = steps
        if not isinstance(step, SubmitRequest) or not step.submission.already_submitted:
            return False
        try:
            return self._manager.port.append_now(step.submission)
        except Exception as exc:
            self._queue_work(list(self._recover(step, exc, collections.deque())))
            return True

    def barge_in(self) -> bool:
        """Cancel the conversation's turn because the user spoke; False if none ran."""
        return self._spawn(self._session.barge_in())

    def cancel(self, *, tag: str | None = None, reason: str = "client_cancelled") -> bool:
        """Cancel the turn named `tag` (default: the conversation's); False if none ran."""
        return self._spawn(self._session.cancel(tag=tag, reason=reason))

    def update_config(self, config: Mapping[str, object]) -> int:
        """Replace the session config for later turns; returns the new generation."""
        return self._session.update_config(config)

    async def settled(self) -> None:
        """Wait until every port call decided so far has been carried out."""
        await self._idle.wait()

    async def close(self) -> None:
        """Cancel every running turn, abort and release every owned request; idempotent.

        Completes even if the caller is cancelled while waiting.
        """
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    def take_events(self) -> list[DuplexEvent]:
        """The events queued so far, in order, without waiting, up to and including the
        first `SpeechDecision`: the reader acts on a decision (a barge-in that cancels
        the turn, whose outputs still queued then go with it) before it takes what was
        queued behind it. A command's events (a cancel's `TurnDone`, say) are here as
        soon as the command returns."""
        taken: list[DuplexEvent] = []
        while self._queue:
            taken.append(self._pop())
            if isinstance(taken[-1], SpeechDecision):
                break
        return taken

    async def room(self) -> None:
        """Return once the port has room for more of the session's input
        (`DuplexStreamingStagePort.input_room`)."""
        await self._manager.port.input_room(self.session_id)

    async def wait_events(self) -> bool:
        """Wait until an event is queued; False once `SessionClosed` was taken (nothing
        more will come)."""
        while not self._queue and not self._events_ended:
            self._ready.clear()
            await self._ready.wait()
        return bool(self._queue)

    async def events(self) -> AsyncGenerator[DuplexEvent, None]:
        """Yield this session's events until (and including) `SessionClosed`, one at a
        time (a turn cancelled while the reader holds an event loses its queued rest)."""
        if self._consuming:
            raise DuplexStateError(f"session {self.session_id} already has an events() reader")
        self._consuming = True
        try:
            while await self.wait_events():
                yield self._pop()
        finally:
            self._consuming = False

    def _pop(self) -> DuplexEvent:
        event = self._queue.popleft()
        if isinstance(event, TurnOutput):
            self._outputs_queued -= 1
        self._events_ended = self._events_ended or isinstance(event, SessionClosed)
        return event

    # -- the shell --------------------------------------------------------------------

    def _on_output(self, out: DuplexStageOutput) -> None:
        # Fail the turn before routing when the reader is behind and the output would
        # join the queue: it and all later ones of the turn are then stale and dropped.
        # An output the client never sees (a turn's last "done") still ends its turn.
        turn = self._session.turn_of(out.request_id)
        full = self._outputs_queued >= self._max_events
        if full and turn is not None and out.shows_client:
            error = f"{self._outputs_queued} events waiting unread; the reader is too slow"
            self._spawn(self._session.fail_turn(turn, error, reason="backpressure"))
        routing = self._session.route_output(out)
        if routing.route is OutputRoute.DROP:
            self._manager._count_drop(routing.drop_reason or "dropped")
        self._spawn(list(routing.steps))

    def _spawn(self, steps: list[SessionStep]) -> bool:
        """Queue the events among `steps` now and their port actions for the worker;
        False when `steps` is empty (nothing was decided)."""
        self._queue_work(self._deliver(steps))
        return bool(steps)

    def _queue_work(self, actions: list[Action]) -> None:
        if actions:
            self._work.append(actions)
            self._idle.clear()
            self._wake.set()
            if self._worker is None:
                self._worker = asyncio.ensure_future(self._run_work())

    async def _run_work(self) -> None:
        while True:
            while self._work:
                await self._execute(self._work.popleft())
            self._idle.set()
            if self._stopping:
                return
            self._wake.clear()
            await self._wake.wait()

    def _deliver(self, steps: list[SessionStep]) -> list[Action]:
        """Queue the events among `steps` now; return the port actions left to run."""
        actions: list[Action] = []
        for step in steps:
            if isinstance(step, TurnDone) and step.status in ("cancelled", "failed"):
                self._drop_queued(step.turn_id)
            if isinstance(step, _EVENT_TYPES):
                self._queue.append(step)
                self._outputs_queued += isinstance(step, TurnOutput)
                self._ready.set()
            else:
                actions.append(step)
        return actions

    def _drop_queued(self, turn_id: int) -> None:
        """A turn ended early: its outputs the reader has not taken yet go with it."""
        kept = [e for e in self._queue if not (isinstance(e, TurnOutput) and e.turn_id == turn_id)]
        dropped = len(self._queue) - len(kept)
        if dropped:
            self._queue = collections.deque(kept)
            self._outputs_queued -= dropped
            self._manager._count_drop("stale", dropped)

    async def _execute(self, actions: list[Action]) -> None:
        pending = collections.deque(actions)
        while pending:
            action = pending.popleft()
            try:
                await self._apply(action)
            except Exception as exc:
                pending = self._recover(action, exc, pending)

    async def _apply(self, action: Action) -> None:
        port = self._manager.port
        if isinstance(action, EnsureRequest):
            port.ensure_request(action.context)
        elif isinstance(action, SubmitRequest):
            context = action.submission.context
            result = await port.submit(action.submission)
            if (result.request_id, result.stage_id) != (context.request_id, context.stage_id):
                raise RuntimeError(
                    f"stage port answered {result.request_id!r} on stage {result.stage_id} "
                    f"for {context.request_id!r} on stage {context.stage_id}"
                )
        elif isinstance(action, AbortRequests):
            await port.abort_requests(list(action.request_ids))
        elif isinstance(action, CleanupRequests):
            await port.cleanup(list(action.request_ids))

    def _recover(
        self, action: Action, exc: Exception, pending: collections.deque[Action]
    ) -> collections.deque[Action]:
        """After a failed port call: a failed reservation or submission fails its turn."""
        if not isinstance(action, (EnsureRequest, SubmitRequest)):
            logger.error("duplex session %s: %s failed: %r", self.session_id, action, exc)
            return pending
        context = action.context if isinstance(action, EnsureRequest) else action.submission.context
        turn_id = self._session.turn_of(context.request_id)
        logger.warning("duplex session %s: turn %s start failed: %r", self.session_id, turn_id, exc)
        # The turn's remaining reservations/submission are moot; its release follows.
        rest = [a for a in pending if not isinstance(a, (EnsureRequest, SubmitRequest))]
        steps = (
            []
            if turn_id is None
            else self._session.fail_turn(turn_id, f"stage {context.stage_id}: {exc}")
        )
        return collections.deque([*rest, *self._deliver(steps)])

    async def _close(self) -> None:
        self.discard_prepared()
        self._spawn(self._session.close())
        # Port calls already under way (e.g. a submit) finish before the slot is freed.
        await self.settled()
        self._stopping = True
        self._wake.set()
        if self._worker is not None:
            await self._worker
        try:
            self._manager.port.close_session(self.session_id)
        except Exception:
            logger.exception("duplex session %s: close_session failed", self.session_id)
        self._manager._forget(self)
