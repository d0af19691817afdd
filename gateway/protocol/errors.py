"""Client errors: a refused client event becomes exactly one `error` event.

Handlers raise `ClientError`; the session turns it into the `error` event, carrying the
refused event's `event_id`, and carries on (a bad event never ends the session).
Pydantic's validation errors are mapped here so every handler names the parameter the
same way.
"""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["ClientError", "item_error", "validation_error"]


class ClientError(Exception):
    """A client event the session refuses; becomes one `error` event."""

    def __init__(
        self, message: str, code: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.kind = kind


def validation_error(exc: ValidationError, prefix: str = "") -> ClientError:
    """The first problem pydantic found, named by its parameter path under `prefix`."""
    first = exc.errors()[0]
    param = prefix + ".".join(str(p) for p in first["loc"])
    if first["type"] == "missing":
        return ClientError(
            f"missing required parameter '{param}'", "missing_required_parameter", param
        )
    if first["type"] == "extra_forbidden":
        return ClientError(f"unknown parameter '{param}'", "unknown_parameter", param)
    return ClientError(f"invalid value for '{param}': {first['msg']}", "invalid_value", param)


def item_error(exc: ValueError) -> ClientError:
    """A refused conversation item: `Item.from_client` raises ValueError(message, param)."""
    if isinstance(exc, ValidationError):
        return validation_error(exc, prefix="item.")
    param = exc.args[1] if len(exc.args) > 1 else "item"
    return ClientError(str(exc.args[0]), "invalid_value", str(param))
