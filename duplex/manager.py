"""The asyncio shell around `DuplexSession`: many sessions over one streaming stage port.

`DuplexSessionManager` attaches itself as the port's output sink, routes every output
to the session it names (`DuplexStageOutput.session_id`), and opens sessions up to
`max_sessions`; each open session is a `DuplexSessionHandle` (`duplex.handle`), which
carries out the actions its session returns: `ensure_request` synchronously, `submit` /
`abort_requests` / `cleanup` awaited, in the order the session produced them (one worker
per session, other sessions unblocked).
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Mapping
from types import MappingProxyType

from duplex.contracts import duplex_session_id_from_request_id
from duplex.errors import (
    DuplexCapacityError,
    DuplexSessionExistsError,
)
from duplex.handle import DuplexSessionHandle
from duplex.outputs import DuplexStageOutput, DuplexStreamingStagePort
from duplex.session import DuplexSession

__all__ = ["DEFAULT_MAX_EVENTS", "DuplexSessionHandle", "DuplexSessionManager"]

# About 10 s of 40 ms audio chunks plus their text deltas: beyond that the client is
# not listening in real time any more.
DEFAULT_MAX_EVENTS = 512
# Closed ids are refused for a while so a late output can never reach a new session
# that reused the id.
_CLOSED_IDS_REMEMBERED = 4096


class DuplexSessionManager:
    """Holds up to `max_sessions` sessions over one streaming stage port."""

    def __init__(
        self,
        port: DuplexStreamingStagePort,
        *,
        max_sessions: int,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._port = port
        self._max_sessions = max_sessions
        self._max_events = max_events
        self._handles: dict[str, DuplexSessionHandle] = {}
        self._closed_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._drops: collections.Counter[str] = collections.Counter()
        port.attach_output_sink(self._on_output)

    @property
    def port(self) -> DuplexStreamingStagePort:
        return self._port

    @property
    def max_sessions(self) -> int:
        return self._max_sessions

    @property
    def dropped_outputs(self) -> Mapping[str, int]:
        """Outputs dropped so far, by reason (`stale`, `closed`, `unknown_session`, ...)."""
        return MappingProxyType(dict(self._drops))

    def __len__(self) -> int:
        return len(self._handles)

    def open(
        self, session_id: str | None = None, *, config: Mapping[str, object] | None = None
    ) -> DuplexSessionHandle:
        """Open a session (id `duplex-<uuid4 hex>` unless given) and return its handle.

        Raises:
            DuplexCapacityError: `max_sessions` sessions are open or still closing.
            DuplexSessionExistsError: `session_id` is open or was closed recently.
        """
        if session_id is None:
            session_id = f"duplex-{uuid.uuid4().hex}"
        if session_id in self._handles or session_id in self._closed_ids:
            raise DuplexSessionExistsError(f"duplex session id {session_id!r} is taken")
        if len(self._handles) >= self._max_sessions:
            raise DuplexCapacityError(
                f"duplex session limit reached ({self._max_sessions} sessions); retry later"
            )
        session = DuplexSession(
            session_id,
            stage_count=self._port.stage_count,
            sampling_defaults=self._port.sampling_defaults(),
            config=config,
        )
        handle = DuplexSessionHandle(self, session, max_events=self._max_events)
        handle._deliver(session.open())
        self._handles[session_id] = handle
        return handle

    def get(self, session_id: str) -> DuplexSessionHandle | None:
        return self._handles.get(session_id)

    def session_for_request(self, request_id: str) -> DuplexSessionHandle | None:
        """The open session a stage request id belongs to, if any."""
        session_id = duplex_session_id_from_request_id(request_id)
        return None if session_id is None else self._handles.get(session_id)

    async def close_all(self) -> None:
        """Close every session (server shutdown)."""
        await asyncio.gather(*(h.close() for h in list(self._handles.values())))

    def _on_output(self, out: DuplexStageOutput) -> None:
        handle = self._handles.get(out.session_id)
        if handle is None:
            self._count_drop("unknown_session")
            return
        handle._on_output(out)

    def _count_drop(self, reason: str, count: int = 1) -> None:
        self._drops[reason] += count

    def _forget(self, handle: DuplexSessionHandle) -> None:
        if self._handles.get(handle.session_id) is handle:
            del self._handles[handle.session_id]
        self._closed_ids[handle.session_id] = None
        while len(self._closed_ids) > _CLOSED_IDS_REMEMBERED:
            self._closed_ids.popitem(last=False)
