"""OpenAI's WebRTC endpoints as HTTP: what a request to them says, and the SDP answer.

- `POST /v1/realtime/client_secrets`: JSON `{expires_after?, session?}` → 200
  `{value: "ek_…", expires_at, session}` (`gateway.webrtc.client_secrets`).
- `POST /v1/realtime/calls`, two forms: `Content-Type: application/sdp` with the offer as
  the body (an ephemeral or the real key), or the unified `multipart/form-data` with the
  fields `sdp` and, optionally, `session` (JSON) (the real key) → 201, the answer as
  `application/sdp`, `Location: /v1/realtime/calls/{call_id}`.
- `POST /v1/realtime/calls/{call_id}/hangup` → 200.
- `OPTIONS` on any of them: the CORS preflight a browser sends before it posts an offer
  with an `Authorization` header from another origin.

Errors are JSON `{error: {type, code, message, param}}`, as the service answers them.
The server's routes (`gateway.webrtc.call_routes`) check keys and room and make the call
(`gateway.webrtc.call.CallConnection`), which the server (`gateway.server.server`) runs.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiortc import (
    RTCConfiguration,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpSender,
    RTCSessionDescription,
)
from websockets.http11 import Response

from gateway.config import IceServer
from gateway.server.handshake import http_response
from gateway.server.http_requests import HttpRequest
from gateway.webrtc.call_audio import PacedAudioTrack

__all__ = [
    "CALLS_PATH",
    "CLIENT_SECRETS_PATH",
    "CallError",
    "CallOffer",
    "answer_offer",
    "call_location",
    "cors_headers",
    "error_answer",
    "hangup_call_id",
    "new_peer",
    "parse_offer",
    "takes_body",
]

CLIENT_SECRETS_PATH = "/v1/realtime/client_secrets"
CALLS_PATH = "/v1/realtime/calls"
_HANGUP = re.compile(r"^/v1/realtime/calls/([A-Za-z0-9_-]{1,64})/hangup$")
# How long the answer may wait for its ICE candidates (host ones take milliseconds; a
# STUN or TURN server that does not answer must not hold the request).
GATHER_TIMEOUT_S = 5.0


class CallError(Exception):
    """A request refused: its status and the protocol's error fields."""

    def __init__(
        self, status: HTTPStatus, code: str, message: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass(frozen=True)
class CallOffer:
    sdp: str
    session: dict[str, Any] | None  # the unified form's `session` field
    unified: bool


def takes_body(method: str, path: str) -> bool:
    """Whether a POST or OPTIONS to `path` has a route here."""
    if method not in ("POST", "OPTIONS"):
        return False
    return path in (CLIENT_SECRETS_PATH, CALLS_PATH) or _HANGUP.match(path) is not None


def hangup_call_id(path: str) -> str | None:
    match = _HANGUP.match(path)
    return match.group(1) if match else None


def call_location(call_id: str) -> str:
    return f"{CALLS_PATH}/{call_id}"


def parse_offer(request: HttpRequest) -> CallOffer:
    """The offer of a `POST /v1/realtime/calls`, in either form; raises CallError."""
    kind = request.headers.get("Content-Type", "")
    media_type = kind.split(";")[0].strip().lower()
    if media_type == "application/sdp":
        return CallOffer(_text(request.body, "sdp"), None, unified=False)
    if media_type == "multipart/form-data":
        fields = _form_fields(kind, request.body)
        if "sdp" not in fields:
            raise CallError(
                HTTPStatus.BAD_REQUEST, "missing_required_parameter", "no sdp field", "sdp"
            )
        session = None
        if "session" in fields:
            try:
                session = json.loads(fields["session"])
            except ValueError as exc:
                raise CallError(
                    HTTPStatus.BAD_REQUEST, "invalid_json", f"session: {exc}", "session"
                ) from None
            if not isinstance(session, dict):
                raise CallError(
                    HTTPStatus.BAD_REQUEST, "invalid_value", "session is an object", "session"
                )
        return CallOffer(fields["sdp"], session, unified=True)
    raise CallError(
        HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        "unsupported_content_type",
        "post the offer as application/sdp, or as multipart/form-data with sdp and session",
    )


def _text(body: bytes, param: str) -> str:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise CallError(
            HTTPStatus.BAD_REQUEST, "invalid_value", f"{param} is not UTF-8", param
        ) from None
    if not text.strip():
        raise CallError(HTTPStatus.BAD_REQUEST, "invalid_value", f"{param} is empty", param)
    return text


def _form_fields(content_type: str, body: bytes) -> dict[str, str]:
    """The text fields of a multipart/form-data body (the standard library's MIME parser)."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise CallError(HTTPStatus.BAD_REQUEST, "invalid_value", "not a multipart body")
    fields: dict[str, str] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str) and isinstance(payload, bytes):
            fields[name] = _text(payload, name)
    return fields


def new_peer(ice_servers: tuple[IceServer, ...]) -> RTCPeerConnection:
    """A peer connection with the configured STUN/TURN servers; none: host candidates
    only (aiortc would otherwise ask a public STUN server)."""
    servers = [
        RTCIceServer(list(s.urls), username=s.username, credential=s.credential)
        for s in ice_servers
    ]
    return RTCPeerConnection(RTCConfiguration(iceServers=servers))


async def answer_offer(peer: RTCPeerConnection, sdp: str, track: PacedAudioTrack) -> str:
    """Take the offer, send `track` on its audio (Opus only), and answer; raises CallError
    for an offer that cannot be answered."""
    try:
        await peer.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
    except ValueError as exc:
        raise CallError(HTTPStatus.BAD_REQUEST, "invalid_offer", str(exc), "sdp") from None
    audio = [t for t in peer.getTransceivers() if t.kind == "audio"]
    if not audio:
        raise CallError(
            HTTPStatus.BAD_REQUEST, "invalid_offer", "the offer has no audio section", "sdp"
        )
    capabilities = RTCRtpSender.getCapabilities("audio")
    opus = [c for c in capabilities.codecs if c.mimeType.lower() == "audio/opus"]
    audio[0].setCodecPreferences(opus)
    peer.addTrack(track)
    try:
        answer = await peer.createAnswer()
        await asyncio.wait_for(peer.setLocalDescription(answer), GATHER_TIMEOUT_S)
    except (ValueError, TimeoutError) as exc:
        raise CallError(HTTPStatus.BAD_REQUEST, "invalid_offer", str(exc), "sdp") from None
    local = peer.localDescription
    assert local is not None
    return local.sdp


def cors_headers(origin: str | None) -> list[tuple[str, str]]:
    """What lets a page of `origin` post an offer and read its answer's Location."""
    if origin is None:
        return []
    return [
        ("Access-Control-Allow-Origin", origin),
        ("Access-Control-Allow-Methods", "POST, OPTIONS"),
        ("Access-Control-Allow-Headers", "Authorization, Content-Type, OpenAI-Beta"),
        ("Access-Control-Expose-Headers", "Location"),
        ("Access-Control-Max-Age", "600"),
        ("Vary", "Origin"),
    ]


def error_answer(status: HTTPStatus, code: str, message: str, param: str | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = {"type": kind, "code": code, "message": message, "param": param}
    return http_response(status, json.dumps({"error": error}).encode(), "application/json")
