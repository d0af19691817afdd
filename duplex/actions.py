"""Actions: what the sans-I/O session asks its shell to do against the stage port.

The session returns lists mixing these with `duplex.events` values; the shell carries
out actions in list order (`EnsureRequest` synchronously, the rest awaited) and hands
events to the session's consumer. `OutputRouting` is the verdict of `route_output`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from duplex.contracts import DuplexOutputDecision, DuplexStageRequestContext, DuplexStageSubmission
from duplex.events import DuplexEvent

__all__ = [
    "AbortRequests",
    "Action",
    "CleanupRequests",
    "EnsureRequest",
    "OutputRoute",
    "OutputRouting",
    "SessionStep",
    "SubmitRequest",
]


@dataclass(frozen=True, slots=True)
class EnsureRequest:
    """Reserve a stage request: `port.ensure_request(context)`."""

    context: DuplexStageRequestContext


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """Start a reserved request: `await port.submit(submission)`."""

    submission: DuplexStageSubmission


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """Stop running requests: `await port.abort_requests(list(request_ids))`."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CleanupRequests:
    """Release requests the session no longer owns: `await port.cleanup(list(ids))`.

    Requests that still needed stopping were named in an `AbortRequests` just before,
    so cleanup never aborts (each abort is issued exactly once).
    """

    request_ids: tuple[str, ...]


Action = EnsureRequest | SubmitRequest | AbortRequests | CleanupRequests
SessionStep = Action | DuplexEvent


class OutputRoute(enum.Enum):
    FORWARD = "forward"  # to the client, as a `TurnOutput` event
    CONSUME = "consume"  # acted on by the session, not shown to the client
    DROP = "drop"  # stale or unknown: ignored


@dataclass(frozen=True, slots=True)
class OutputRouting:
    """What `DuplexSession.route_output` decided, and the steps that follow from it.

    `decision` is set for CONSUME, `drop_reason` for DROP (`"closed"`, `"stale"`,
    `"unknown_request"`, `"stage_mismatch"`, `"after_finish"`). `steps` holds the
    `TurnOutput` for FORWARD and, when the output ended its turn, the abort/cleanup
    actions and the `TurnDone`.
    """

    route: OutputRoute
    steps: tuple[SessionStep, ...] = ()
    decision: DuplexOutputDecision | None = None
    drop_reason: str | None = None
