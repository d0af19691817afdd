"""Ephemeral client secrets (`POST /v1/realtime/client_secrets`): short-lived `ek_` keys a
backend mints for a browser, so the browser can create one WebRTC call without holding
the real key.

Rules of this module:

1. A secret authorises `POST /v1/realtime/calls` only (`gateway.webrtc.calls`); the WebSocket
   and every other route still take the real key alone.
2. A secret expires at `expires_at` (unix seconds): `expires_after.seconds` after it was
   minted (anchor `created_at`, the one anchor), 10 s to 2 h, ten minutes by default.
   An expired secret is unknown.
3. A secret carries the session config it was minted with; a call made with it starts
   with that config applied (`RealtimeSession.start_with`), and its client may still
   change it with `session.update`.
4. At most `max_kept` secrets are kept: minting beyond them first drops the expired ones,
   then refuses. A secret is not spent by a call (the service lets it make several
   until it expires), so a flood of mints is bounded here, not by use.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ClientSecret",
    "ClientSecrets",
    "MintRequest",
    "SecretError",
    "is_ephemeral",
    "parse_mint_request",
]

PREFIX = "ek_"
DEFAULT_SECONDS = 600
MIN_SECONDS = 10
MAX_SECONDS = 7200


class SecretError(ValueError):
    """A mint request the gateway refuses: the protocol's `error` fields."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(default=DEFAULT_SECONDS, ge=MIN_SECONDS, le=MAX_SECONDS)


class MintRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expires_after: ExpiresAfter = Field(default_factory=ExpiresAfter)
    session: dict[str, Any] = Field(default_factory=dict)


def parse_mint_request(body: object) -> MintRequest:
    """The request's JSON body, checked; raises SecretError."""
    if not isinstance(body, dict):
        raise SecretError("the body is a JSON object", "invalid_request_body")
    try:
        return MintRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise SecretError(first["msg"], "invalid_value", param) from None


@dataclass(frozen=True)
class ClientSecret:
    value: str
    expires_at: int  # unix seconds (rule 2)
    session: dict[str, Any]  # the config a call made with it starts with (rule 3)


class ClientSecrets:
    """The secrets minted and not yet expired."""

    def __init__(self, *, max_kept: int = 10_000, clock: Callable[[], float] = time.time) -> None:
        self.max_kept = max_kept
        self._clock = clock
        self._secrets: dict[str, ClientSecret] = {}

    def __len__(self) -> int:
        return len(self._secrets)

    def mint(self, request: MintRequest) -> ClientSecret:
        if len(self._secrets) >= self.max_kept:
            self._drop_expired()
        if len(self._secrets) >= self.max_kept:
            raise SecretError(
                f"{self.max_kept} client secrets are live; try again when some expire",
                "too_many_client_secrets",
            )
        expires_at = int(self._clock()) + request.expires_after.seconds
        secret = ClientSecret(PREFIX + secrets.token_urlsafe(24), expires_at, request.session)
        self._secrets[secret.value] = secret
        return secret

    def find(self, value: str) -> ClientSecret | None:
        """The live secret `value`; None if none was minted or it expired (rule 2)."""
        secret = self._secrets.get(value)
        if secret is not None and secret.expires_at <= self._clock():
            del self._secrets[value]
            return None
        return secret

    def _drop_expired(self) -> None:
        now = self._clock()
        for value in [v for v, s in self._secrets.items() if s.expires_at <= now]:
            del self._secrets[value]


def is_ephemeral(key: str) -> bool:
    return key.startswith(PREFIX)
