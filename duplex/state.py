"""The duplex session's states and every transition between them, in one table.

Rule 1: a session changes state only through `transition`; anything not in
`TRANSITIONS` is a caller error (`DuplexStateError`), never a silent no-op.
Rule 2: this file knows nothing of requests, fences or outputs; `duplex.session` turns
transitions into actions.
"""

from __future__ import annotations

import enum

from duplex.errors import DuplexStateError

__all__ = ["SessionState", "TRANSITIONS", "TurnEvent", "transition"]


class SessionState(enum.Enum):
    CREATED = "created"  # built, not yet opened
    IDLE = "idle"  # open, no response in flight
    RESPONDING = "responding"  # the conversation's turn has stage requests in flight
    CLOSED = "closed"  # terminal


class TurnEvent(enum.Enum):
    OPEN = "open"
    UPDATE_CONFIG = "update_config"
    START_TURN = "start_turn"
    START_SIDE_TURN = "start_side_turn"  # a turn beside the conversation's (any number)
    COMPLETE_TURN = "complete_turn"  # the final stage's request finished
    FAIL_TURN = "fail_turn"  # a stage request of the turn failed
    CANCEL_TURN = "cancel_turn"  # barge-in or client cancel
    CLOSE = "close"


_S, _E = SessionState, TurnEvent

TRANSITIONS: dict[SessionState, dict[TurnEvent, SessionState]] = {
    _S.CREATED: {_E.OPEN: _S.IDLE, _E.CLOSE: _S.CLOSED},
    _S.IDLE: {
        _E.UPDATE_CONFIG: _S.IDLE,
        _E.START_TURN: _S.RESPONDING,
        _E.START_SIDE_TURN: _S.IDLE,
        _E.CANCEL_TURN: _S.IDLE,  # nothing to cancel: idempotent
        _E.CLOSE: _S.CLOSED,
    },
    _S.RESPONDING: {
        _E.UPDATE_CONFIG: _S.RESPONDING,  # applies from the next turn on
        _E.START_SIDE_TURN: _S.RESPONDING,
        _E.COMPLETE_TURN: _S.IDLE,
        _E.FAIL_TURN: _S.IDLE,
        _E.CANCEL_TURN: _S.IDLE,
        _E.CLOSE: _S.CLOSED,
    },
    _S.CLOSED: {_E.CANCEL_TURN: _S.CLOSED, _E.CLOSE: _S.CLOSED},
}


def transition(state: SessionState, event: TurnEvent) -> SessionState:
    """The state after `event`, or `DuplexStateError` if `state` cannot take it."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        hint = " (a response is active: barge in or cancel it first)"
        detail = hint if (state, event) == (_S.RESPONDING, _E.START_TURN) else ""
        raise DuplexStateError(
            f"duplex session can't handle {event.value} in state {state.value}{detail}"
        ) from None
