"""HTTP requests with a body (POST, and the CORS preflight OPTIONS) on the WebSocket
port: read whole with h11, bounded, before any route sees them.

websockets' parser knows only GET; `gateway.server.handshake.GatewayConnection` hands a request
with another method to a `RequestReader` instead, and its route's answer goes back on
the same connection, which then closes (one request per connection, as for GETs).
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import h11
from websockets.datastructures import Headers

__all__ = ["BODY_METHODS", "HttpError", "HttpRequest", "RequestReader"]

BODY_METHODS = ("POST", "OPTIONS")
MAX_HEADER_BYTES = 16 * 1024


class HttpError(Exception):
    """A request that cannot be read: answered with `status`."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HttpRequest:
    method: str
    target: str
    headers: Headers
    body: bytes

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    def query(self, name: str) -> str | None:
        values = parse_qs(urlsplit(self.target).query).get(name)
        return values[0] if values else None


class RequestReader:
    """Bytes in, one whole request out (or an HttpError)."""

    def __init__(self, max_body_bytes: int) -> None:
        self._max_body = max_body_bytes
        self._parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self._head: h11.Request | None = None
        self._body = bytearray()

    def feed(self, data: bytes) -> HttpRequest | None:
        """The request, once `data` completed it; None while more is needed."""
        self._parser.receive_data(data)
        while True:
            try:
                event = self._parser.next_event()
            except h11.RemoteProtocolError as exc:
                raise HttpError(HTTPStatus(exc.error_status_hint), str(exc)) from None
            if event is h11.NEED_DATA:
                if not data:
                    raise HttpError(HTTPStatus.BAD_REQUEST, "the request ended early")
                return None
            if isinstance(event, h11.Request):
                self._head = event
                self._check_length(event)
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > self._max_body:
                    raise self._too_large()
            elif isinstance(event, h11.EndOfMessage):
                return self._request()
            else:  # ConnectionClosed, or a pause h11 would not give a server mid-request
                raise HttpError(HTTPStatus.BAD_REQUEST, "the request ended early")

    def _check_length(self, head: h11.Request) -> None:
        for name, value in head.headers:
            if name == b"content-length" and int(value) > self._max_body:
                raise self._too_large()

    def _too_large(self) -> HttpError:
        return HttpError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {self._max_body} bytes"
        )

    def _request(self) -> HttpRequest:
        assert self._head is not None
        headers = Headers(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in self._head.headers
        )
        return HttpRequest(
            self._head.method.decode("ascii"),
            self._head.target.decode("latin-1"),
            headers,
            bytes(self._body),
        )
