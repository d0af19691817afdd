"""What a GET request to the server carries: the API key, the protocol shape it speaks,
and the query parameters that choose a session.

A WebSocket client sends its key as a Bearer header or, from a browser, as the
`openai-insecure-api-key.` subprotocol; /metrics and /web take it as `?api_key=` or the
cookie the page was served with, too. Beta clients say so in `OpenAI-Beta` or with the
beta subprotocol. `?intent=transcription` asks for a transcription session, and
`?call_id=` joins a WebRTC call's session.
"""

from __future__ import annotations

from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs, urlsplit

from websockets.http11 import Request

__all__ = [
    "BETA_PROTOCOL",
    "INTENT_TRANSCRIPTION",
    "KEY_COOKIE",
    "KEY_PROTOCOL_PREFIX",
    "api_key",
    "call_id",
    "cookie_key",
    "intent",
    "is_beta",
    "query_key",
]

KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."
KEY_COOKIE = "duplex_gateway_key"
BETA_PROTOCOL = "openai-beta.realtime-v1"
INTENT_TRANSCRIPTION = "transcription"  # ?intent=transcription: a transcription session


def _offered_protocols(request: Request) -> list[str]:
    values = request.headers.get_all("Sec-WebSocket-Protocol")
    return [p.strip() for value in values for p in value.split(",") if p.strip()]


def is_beta(request: Request) -> bool:
    header = request.headers.get("OpenAI-Beta", "")
    return "realtime=v1" in header.replace(" ", "") or BETA_PROTOCOL in _offered_protocols(request)


def intent(request: Request) -> str | None:
    """`?intent=`: "transcription" asks for a transcription session."""
    values = parse_qs(urlsplit(request.path).query).get("intent")
    return values[0] if values else None


def api_key(request: Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    for proto in _offered_protocols(request):
        if proto.startswith(KEY_PROTOCOL_PREFIX):
            return proto[len(KEY_PROTOCOL_PREFIX) :]
    return None


def call_id(request: Request) -> str | None:
    """`?call_id=`: a sideband WebSocket, joining that call's session."""
    values = parse_qs(urlsplit(request.path).query).get("call_id")
    return values[0] if values else None


def query_key(request: Request) -> str | None:
    values = parse_qs(urlsplit(request.path).query).get("api_key")
    return values[0] if values else None


def cookie_key(request: Request) -> str | None:
    cookies = SimpleCookie()
    try:
        cookies.load(request.headers.get("Cookie", ""))
    except CookieError:
        return None
    morsel = cookies.get(KEY_COOKIE)
    return morsel.value if morsel is not None else None
