"""What a realtime session has decided and its shell has not yet taken: server events
for the client and actions for the layers below, each in the order decided.

Every part of the session writes here, so the order of events on the wire and of
actions against the backend is the order the session decided them in.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol.errors import ClientError
from gateway.protocol.events import new_id, to_beta
from gateway.session.actions import Action, ConfigureVad

__all__ = ["Outbox", "ServerEvent"]

# A server event as sent: JSON-ready, in the GA shape unless the client speaks beta.
ServerEvent = dict[str, Any]


class Outbox:
    def __init__(self, *, beta: bool) -> None:
        self.beta = beta
        self._events: list[ServerEvent] = []
        self._actions: list[Action] = []

    def emit(self, kind: str, **fields: Any) -> None:
        """A server event, built in the GA shape; renamed (or dropped) for beta clients."""
        event: ServerEvent = {"type": kind, "event_id": new_id("event"), **fields}
        if self.beta:
            renamed = to_beta(event)
            if renamed is None:
                return  # beta has no such event
            event = renamed
        self._events.append(event)

    def error(self, exc: ClientError, event_id: str | None) -> None:
        error = {
            "type": exc.kind,
            "code": exc.code,
            "message": str(exc),
            "param": exc.param,
            "event_id": event_id,
        }
        self.emit("error", error=error)

    def act(self, action: Action) -> None:
        self._actions.append(action)

    def take_events(self) -> list[ServerEvent]:
        events, self._events = self._events, []
        return events

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def retract_greeting(self) -> None:
        """Forget what a new session decided on its own (its `session.created` and the
        VAD start): the connection is refused before it begins."""
        self._events.clear()
        self._actions = [a for a in self._actions if not isinstance(a, ConfigureVad)]
