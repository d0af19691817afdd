"""Exceptions the duplex core raises to its caller (the gateway).

All of them mean the caller asked for something the session cannot do now; the session
itself is unchanged and goes on.
"""

from __future__ import annotations

__all__ = [
    "DuplexBackpressureError",
    "DuplexCapacityError",
    "DuplexError",
    "DuplexSessionExistsError",
    "DuplexStateError",
]


class DuplexError(Exception):
    """Base class of every error the duplex core raises on purpose."""


class DuplexStateError(DuplexError):
    """An operation that the session's current state does not allow (e.g. a second
    turn while a response is active, or anything but `close` after close)."""


class DuplexCapacityError(DuplexError):
    """The manager already holds `max_sessions` sessions; retry later."""


class DuplexSessionExistsError(DuplexError):
    """A session with this id is open, or was closed too recently to reuse its id."""


class DuplexBackpressureError(DuplexError):
    """The session's event queue is too full to start another turn: the consumer of
    `DuplexSessionHandle.events()` is not keeping up."""
