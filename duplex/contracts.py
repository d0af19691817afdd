"""Model-neutral value types and request-id codec shared by every duplex component.

Rules of this module:

1. Every value type is frozen. Mapping fields are copied into a read-only
   `MappingProxyType` and sequences into tuples when the value is built, so a value
   can be shared between the session core, the stage port and the engine thread
   without anyone mutating it behind the others' backs.
2. Stage request ids follow one grammar::

       duplex-s.<base64url(utf-8 session id) without "=">.e.<epoch>.r.<role>

   `role` is `[A-Za-z0-9_-]+`. A long-lived (resumable) stage request has role
   `stage{N}`; a per-turn (ephemeral) one `stage{N}-turn{T}`. Neither the base64url
   alphabet nor the role alphabet contains `.`, so splitting on `.` is unambiguous.
3. Parsers are total: any malformed input (wrong part count, non-canonical base64,
   non-decimal epoch, a bad role, a non-string) yields `None` (or `False`/`[]`),
   never an exception. Builders raise `ValueError` on invalid input.
4. This module is the seed's public contract and is kept whole, as API for other stage
   ports and callers: `DuplexOutputContext`, `DuplexRequestIdentity`,
   `duplex_data_plane_request_info` and `duplex_resource_request_belongs_to_session` are
   part of it though the gateway and the engine do not call them (`tests/test_contracts.py`
   does).
"""

from __future__ import annotations

import base64
import binascii
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

__all__ = [
    "DuplexAppendPlan",
    "DuplexFence",
    "DuplexOutputAction",
    "DuplexOutputContext",
    "DuplexOutputDecision",
    "DuplexRequestIdentity",
    "DuplexStagePort",
    "DuplexStageRequestContext",
    "DuplexStageSubmission",
    "DuplexStageSubmissionResult",
    "duplex_data_plane_request_info",
    "duplex_ephemeral_stage_request_id",
    "duplex_resource_request_belongs_to_session",
    "duplex_resource_request_id",
    "duplex_same_turn_request_ids",
    "duplex_session_id_from_request_id",
    "duplex_turn_id_from_request_id",
]

REQUEST_ID_PREFIX = "duplex-s"
_ROLE_RE = re.compile(r"[A-Za-z0-9_-]+")
# Canonical decimal only: "007", "+1", "1_0" or non-ASCII digits would break the
# one-id-per-fence property, so they count as malformed.
_DECIMAL_RE = re.compile(r"0|[1-9][0-9]*")
_B64URL_RE = re.compile(r"[A-Za-z0-9_-]*")
_EPHEMERAL_ROLE_RE = re.compile(r"stage(0|[1-9][0-9]*)-turn(0|[1-9][0-9]*)")


def _frozen_mapping(value: Mapping[str, object]) -> Mapping[str, object]:
    # Copy first: a proxy over the caller's dict would still change when they mutate it.
    return MappingProxyType(dict(value))


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _require_count(owner: str, name: str, value: object) -> None:
    if not _is_count(value):
        raise ValueError(f"{owner}.{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True, slots=True)
class DuplexFence:
    """Engine-internal session identity used for stage request ids and stale filtering.

    `epoch` moves when the conversation's turn is cancelled; `turn_id` when a turn starts. An
    output whose fence is older than the session's is stale.
    """

    session_id: str
    epoch: int = 0
    turn_id: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str):
            raise ValueError(f"DuplexFence.session_id must be a str, got {self.session_id!r}")
        try:
            self.session_id.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError("DuplexFence.session_id must be encodable as UTF-8") from exc
        _require_count("DuplexFence", "epoch", self.epoch)
        _require_count("DuplexFence", "turn_id", self.turn_id)


class DuplexOutputAction(str, Enum):
    """What a consumed (non-forwarded) stage output means."""

    DIRECT_RESPONSE = "direct_response"


@dataclass(frozen=True)
class DuplexAppendPlan:
    """The entry stage's prompt for one committed unit of input (audio or text)."""

    prompt: Mapping[str, object]

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, Mapping):
            raise ValueError(f"DuplexAppendPlan.prompt must be a mapping, got {self.prompt!r}")
        object.__setattr__(self, "prompt", _frozen_mapping(self.prompt))


@dataclass(frozen=True)
class DuplexRequestIdentity:
    """Which session and fence an output belongs to."""

    session_id: str
    fence: DuplexFence

    def __post_init__(self) -> None:
        if self.fence.session_id != self.session_id:
            raise ValueError(
                f"DuplexRequestIdentity.fence belongs to session {self.fence.session_id!r}, "
                f"not {self.session_id!r}"
            )


@dataclass(frozen=True)
class DuplexOutputContext:
    """What the stage port knows about one session-owned stage output."""

    identity: DuplexRequestIdentity
    final_stage_id: int
    segment_finished: bool
    segment_token_ids: tuple[int, ...] = ()
    segment_output_metadata: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "segment_token_ids", tuple(self.segment_token_ids))
        object.__setattr__(
            self, "segment_output_metadata", _frozen_mapping(self.segment_output_metadata)
        )


@dataclass(frozen=True)
class DuplexOutputDecision:
    """The verdict on a non-final stage output that is consumed instead of forwarded."""

    action: DuplexOutputAction
    final_output_type: str = "text"
    metadata: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", DuplexOutputAction(self.action))
        object.__setattr__(self, "metadata", _frozen_mapping(self.metadata))


@dataclass(frozen=True)
class DuplexStageRequestContext:
    """Frozen snapshot of everything a stage needs to run one session-owned request.

    `sampling_params` holds one entry per stage (index = stage id); the stage's own
    entry is `stage_sampling_params`.
    """

    request_id: str
    session_id: str
    fence: DuplexFence
    stage_id: int
    final_stage_id: int
    config_generation: int
    sampling_params: tuple[object, ...]
    session_config: Mapping[str, object] = field(default_factory=dict)
    runtime_config: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampling_params", tuple(self.sampling_params))
        object.__setattr__(self, "session_config", _frozen_mapping(self.session_config))
        object.__setattr__(self, "runtime_config", _frozen_mapping(self.runtime_config))
        _require_count("DuplexStageRequestContext", "stage_id", self.stage_id)
        _require_count("DuplexStageRequestContext", "final_stage_id", self.final_stage_id)
        _require_count("DuplexStageRequestContext", "config_generation", self.config_generation)
        if self.stage_id >= len(self.sampling_params):
            raise ValueError(
                f"DuplexStageRequestContext.sampling_params has {len(self.sampling_params)} "
                f"entries, none for stage {self.stage_id}"
            )
        if self.fence.session_id != self.session_id:
            raise ValueError("DuplexStageRequestContext.fence belongs to another session")

    @property
    def stage_sampling_params(self) -> object:
        return self.sampling_params[self.stage_id]


@dataclass(frozen=True)
class DuplexStageSubmission:
    """One prompt for a reserved stage request.

    `resumable=True` resumes or updates a resident request id; `False` opens a fresh
    ephemeral (per-turn) id.
    """

    context: DuplexStageRequestContext
    prompt: Mapping[str, object]
    already_submitted: bool
    resumable: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", _frozen_mapping(self.prompt))


@dataclass(frozen=True)
class DuplexStageSubmissionResult:
    request_id: str
    stage_id: int
    replica_id: int


class DuplexStagePort(ABC):
    """The narrow stage-management surface the duplex session manager drives."""

    @property
    @abstractmethod
    def stage_count(self) -> int: ...

    @abstractmethod
    def sampling_defaults(self) -> tuple[object, ...]:
        """One default sampling-parameter object per stage, indexed by stage id."""

    @abstractmethod
    def ensure_request(self, context: DuplexStageRequestContext) -> None:
        """Reserve `context.request_id` on `context.stage_id` (synchronous, no I/O wait)."""

    @abstractmethod
    async def submit(self, submission: DuplexStageSubmission) -> DuplexStageSubmissionResult:
        """Start (or update) the reserved request with the submission's prompt."""

    @abstractmethod
    async def cleanup(self, request_ids: list[str], *, abort: bool = False) -> None:
        """Release reserved/finished requests; with `abort=True` stop running ones first."""

    @abstractmethod
    async def abort_requests(self, request_ids: list[str]) -> None:
        """Stop the requests at the next engine step; none of them outputs anything after."""


# -- request-id codec ---------------------------------------------------------------


def _encode_session_id(session_id: str) -> str:
    return base64.urlsafe_b64encode(session_id.encode("utf-8")).decode("ascii").rstrip("=")


def _decode_session_id(encoded: str) -> str | None:
    if _B64URL_RE.fullmatch(encoded) is None or len(encoded) % 4 == 1:
        return None
    try:
        raw = base64.b64decode(encoded + "=" * (-len(encoded) % 4), altchars=b"-_", validate=True)
        session_id = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    # Non-zero padding bits decode fine but never come out of the encoder.
    return session_id if _encode_session_id(session_id) == encoded else None


def _resource_request_fields(request_id: object) -> tuple[str, int, str] | None:
    """Split a well-formed id into (encoded session id, epoch, role), else None."""
    if not isinstance(request_id, str):
        return None
    parts = request_id.split(".")
    if len(parts) != 6 or parts[0] != REQUEST_ID_PREFIX or parts[2] != "e" or parts[4] != "r":
        return None
    encoded, epoch, role = parts[1], parts[3], parts[5]
    if _DECIMAL_RE.fullmatch(epoch) is None or _ROLE_RE.fullmatch(role) is None:
        return None
    if _decode_session_id(encoded) is None:
        return None
    return encoded, int(epoch), role


def _ephemeral_role(role: str) -> tuple[int, int] | None:
    match = _EPHEMERAL_ROLE_RE.fullmatch(role)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def duplex_resource_request_id(fence: DuplexFence, role: str) -> str:
    """Build `duplex-s.<b64url(session)>.e.<epoch>.r.<role>`.

    Raises:
        ValueError: `role` is empty or uses a character outside `[A-Za-z0-9_-]`.
    """
    if not isinstance(role, str) or _ROLE_RE.fullmatch(role) is None:
        raise ValueError(
            f"duplex request role must be a non-empty string of [A-Za-z0-9_-], got {role!r}"
        )
    return f"{REQUEST_ID_PREFIX}.{_encode_session_id(fence.session_id)}.e.{fence.epoch}.r.{role}"


def duplex_ephemeral_stage_request_id(fence: DuplexFence, *, stage_id: int) -> str:
    """Turn-scoped stage request id `...r.stage{N}-turn{T}` for non-resumable requests."""
    _require_count("duplex_ephemeral_stage_request_id", "stage_id", stage_id)
    return duplex_resource_request_id(fence, f"stage{stage_id}-turn{fence.turn_id}")


def duplex_session_id_from_request_id(request_id: str | None) -> str | None:
    """Decode the session id of a well-formed duplex request id, else None."""
    fields = _resource_request_fields(request_id)
    return None if fields is None else _decode_session_id(fields[0])


def duplex_turn_id_from_request_id(request_id: str | None) -> int | None:
    """The turn `T` of a well-formed ephemeral `...r.stage{N}-turn{T}` id, else None."""
    fields = _resource_request_fields(request_id)
    parsed = None if fields is None else _ephemeral_role(fields[2])
    return None if parsed is None else parsed[1]


def duplex_same_turn_request_ids(request_id: str, candidate_ids: Iterable[str]) -> list[str]:
    """Other ephemeral stage ids of the same session, epoch and turn as `request_id`.

    `request_id` itself is not included; resumable or malformed candidates are ignored;
    candidate order is preserved.
    """
    fields = _resource_request_fields(request_id)
    turn = None if fields is None else _ephemeral_role(fields[2])
    if fields is None or turn is None:
        return []
    same: list[str] = []
    for candidate in candidate_ids:
        other = _resource_request_fields(candidate)
        if other is None or candidate == request_id or other[:2] != fields[:2]:
            continue
        other_turn = _ephemeral_role(other[2])
        if other_turn is not None and other_turn[1] == turn[1]:
            same.append(candidate)
    return same


def duplex_resource_request_belongs_to_session(request_id: str, session_id: str) -> bool:
    """Whether `request_id` is a well-formed duplex id of `session_id`."""
    fields = _resource_request_fields(request_id)
    if fields is None or not isinstance(session_id, str):
        return False
    try:
        return fields[0] == _encode_session_id(session_id)
    except UnicodeEncodeError:
        return False


def duplex_data_plane_request_info(result: dict[str, object]) -> tuple[str | None, int | None]:
    """`(request_id, response_stage_id)` of the first data-plane append in `result`.

    Scans `result["stage_results"]` for an item whose `result` dict has
    `data_plane_append is True` and a non-empty string `request_id`.
    """
    stage_results = result.get("stage_results") if isinstance(result, Mapping) else None
    if not isinstance(stage_results, (list, tuple)):
        return None, None
    for item in stage_results:
        inner = item.get("result") if isinstance(item, Mapping) else None
        if not isinstance(inner, Mapping) or inner.get("data_plane_append") is not True:
            continue
        request_id = inner.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            continue
        stage_id = inner.get("response_stage_id")
        valid_stage = isinstance(stage_id, int) and not isinstance(stage_id, bool)
        return request_id, stage_id if valid_stage else None
    return None, None
