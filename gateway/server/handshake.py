"""The HTTP side of a connection before it is a WebSocket: bounded pending handshakes,
HEAD, and an answer to every request websockets' parser refuses.

websockets' HTTP parser only knows GET and closes without a word on anything else;
`GatewayConnection` (the server's `create_connection`) sits in front of it to admit
HEAD, hand POST and OPTIONS to the server's HTTP routes (`gateway.server.http_requests`),
answer a malformed request with its status (405, 414, 431, 400) and bound the
connections still sending their request. It is written against websockets 15, whose
server connection it extends (pyproject.toml pins the major version).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import InvalidHandshake, InvalidMessage, SecurityError
from websockets.http11 import MAX_LINE_LENGTH, Response

from gateway.config import SessionLimits
from gateway.server.http_requests import BODY_METHODS, HttpError, HttpRequest, RequestReader
from gateway.server.metrics import GatewayMetrics

__all__ = [
    "ALLOW_HTTP",
    "GatewayConnection",
    "HttpRoutes",
    "PendingHandshakes",
    "connection_type",
    "error_response",
    "http_response",
    "not_allowed",
]

logger = logging.getLogger("gateway.server.server")

ALLOW_HTTP = "GET, HEAD"  # every route but /v1/realtime, which takes GET only


@dataclass(frozen=True)
class HttpRoutes:
    """The server's routes for requests with a body (`gateway.server.http_requests`)."""

    answer: Callable[[HttpRequest], Awaitable[Response]]
    takes_body: Callable[[str, str], bool]  # (method, path): whether a route takes it


MAX_BODY_BYTES = 256 * 1024  # an SDP offer is a few kB; a session config, a few more


class PendingHandshakes:
    """Connections that have not yet sent a whole request, per process and per address."""

    def __init__(self, limits: SessionLimits) -> None:
        self.limit = limits.max_pending_handshakes
        self.limit_per_address = limits.max_pending_handshakes_per_address
        self.total = 0
        self.by_address: Counter[str] = Counter()

    def enter(self, address: str) -> bool:
        if self.total >= self.limit or self.by_address[address] >= self.limit_per_address:
            return False
        self.total += 1
        self.by_address[address] += 1
        return True

    def leave(self, address: str) -> None:
        self.total -= 1
        self.by_address[address] -= 1
        if not self.by_address[address]:
            del self.by_address[address]


class GatewayConnection(ServerConnection):
    """websockets' server connection, with what its HTTP handling leaves out.

    - Pending handshakes are bounded. A connection counts from `connection_made` until
      its request has been parsed (`process_event`) or it is lost; beyond a bound it is
      answered 503 at once, before it has sent anything, and closed. The handshake
      timeout (`open_timeout`) still closes the ones inside the bound that never finish.
    - HEAD is admitted: the parser accepts only GET, so the method is read off the
      first bytes and a HEAD is handed on as a GET; `_process_request` drops the body.
    - POST and OPTIONS never reach websockets: the request is read whole (bounded) and
      answered by `http_routes`; the connection then closes.
    - A request the parser refuses gets its status instead of a silent close, and a
      client's mistake is logged as one line, not an ERROR with a traceback.

    `pending` and `metrics` are set per server by `connection_type`.
    """

    pending: ClassVar[PendingHandshakes]
    metrics: ClassVar[GatewayMetrics]
    http_routes: ClassVar[HttpRoutes]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.method: str | None = None  # as the client sent it, HEAD included
        self._first_bytes = b""  # held until the method is known
        self._request_line_bytes = 0  # so far: tells a long request line from a header
        self._request_line_ended = False
        self._pending_address: str | None = None
        self._answered = False
        self._with_body: bytearray | None = None  # a POST's or OPTIONS' first bytes
        self._reader: RequestReader | None = None  # reading it, once its route takes it
        self._serving: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        address = _peer_address(transport)
        if not self.pending.enter(address):
            self.metrics.rejected.labels("too_many_pending_handshakes").inc()
            logger.debug("refused a connection from %s: too many pending handshakes", address)
            self._answer(
                error_response(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections opening")
            )
            return
        self._pending_address = address

    def connection_lost(self, exc: Exception | None) -> None:
        self._leave_pending()
        super().connection_lost(exc)

    def process_event(self, event: Any) -> None:
        if self.request is None:  # the first event is the parsed request
            self._leave_pending()
        super().process_event(event)

    def data_received(self, data: bytes) -> None:
        if self._with_body is not None:
            self._read_http(data)
            return
        if not self._request_line_ended:
            end = data.find(b"\n")
            self._request_line_ended = end >= 0
            self._request_line_bytes += end if end >= 0 else len(data)
        if self.method is None:
            self._first_bytes += data
            method, space, rest = self._first_bytes.partition(b" ")
            if not space and len(self._first_bytes) <= len(b"OPTIONS"):
                return  # the method may go on in the next segment
            self.method = method.decode("ascii", "replace")
            data = b"GET " + rest if self.method == "HEAD" else self._first_bytes
            self._first_bytes = b""
            if self.method in BODY_METHODS:
                self._with_body = bytearray()
                self._read_http(data)
                return
        super().data_received(data)

    def eof_received(self) -> None:
        if self._with_body is not None:
            self._read_http(b"")  # the client stopped before a whole request: 400
            return
        super().eof_received()

    def _read_http(self, data: bytes) -> None:
        """A request with a body: its request line names a route that takes one (else
        405), then h11 reads it whole and `http_routes` answers it."""
        if self._answered or self._serving is not None or self._with_body is None:
            return  # one request per connection: anything after it is ignored
        if self._reader is None:
            self._with_body += data
            line, newline, _ = bytes(self._with_body).partition(b"\n")
            if not newline:
                if not data:
                    self._answer_http(error_response(HTTPStatus.BAD_REQUEST, "no request line"))
                elif len(self._with_body) > MAX_LINE_LENGTH:
                    self._answer_http(
                        error_response(HTTPStatus.REQUEST_URI_TOO_LONG, "request line too long")
                    )
                return
            target = line.split(b" ")[1] if line.count(b" ") >= 2 else b""
            path = urlsplit(target.decode("latin-1")).path
            if not self.http_routes.takes_body(self.method or "", path):
                self._answer_http(not_allowed(ALLOW_HTTP))
                return
            self._reader = RequestReader(MAX_BODY_BYTES)
            data = bytes(self._with_body)
        try:
            request = self._reader.feed(data)
        except HttpError as exc:
            self._answer_http(error_response(exc.status, str(exc)))
            return
        if request is not None:
            self._leave_pending()
            self._serving = asyncio.create_task(self._serve_http(request), name="http")

    def _answer_http(self, response: Response) -> None:
        self._leave_pending()
        self._answer(response)

    async def _serve_http(self, request: HttpRequest) -> None:
        try:
            response = await self.http_routes.answer(request)
        except Exception:
            logger.exception("%s %s failed", request.method, request.path)
            response = error_response(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")
        if not self.transport.is_closing():
            self._answer(response)

    def send_data(self) -> None:
        # A request the parser refused sets `handshake_exc` and queues a half-close,
        # sent here; the answer goes out just before it.
        failure = self.protocol.handshake_exc
        if self.request is None and isinstance(failure, InvalidMessage) and not self._answered:
            response = self._answer_to(failure.__cause__)
            if response is not None:
                self._answer(response)
        super().send_data()

    async def handshake(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().handshake(*args, **kwargs)
        except InvalidHandshake as exc:
            # The client's mistake, already answered or gone: websockets would log an
            # ERROR with a traceback. Returning leaves the connection not OPEN, which
            # websockets closes quietly.
            cause = exc.__cause__
            level = logging.DEBUG if isinstance(cause, EOFError) else logging.INFO
            detail = f": {cause}" if cause is not None else ""
            logger.log(level, "bad request from %s: %s%s", self._peer(), exc, detail)

    def _answer_to(self, cause: BaseException | None) -> Response | None:
        if cause is None or isinstance(cause, EOFError):
            return None  # the client left before a whole request
        if isinstance(cause, SecurityError):
            if str(cause) == "line too long" and self._request_line_bytes >= MAX_LINE_LENGTH:
                return error_response(HTTPStatus.REQUEST_URI_TOO_LONG, "request line too long")
            return error_response(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, str(cause))
        method = self.method or ""
        if method not in ("GET", "HEAD") and method.isalpha() and method.isupper():
            return not_allowed(ALLOW_HTTP)
        return error_response(HTTPStatus.BAD_REQUEST, str(cause))

    def _answer(self, response: Response) -> None:
        self._answered = True
        self.transport.write(response.serialize())
        self.transport.close()  # after the answer is written

    def _leave_pending(self) -> None:
        if self._pending_address is not None:
            self.pending.leave(self._pending_address)
            self._pending_address = None

    def _peer(self) -> str:
        return _peer_address(self.transport)


def connection_type(
    pending: PendingHandshakes, metrics: GatewayMetrics, http_routes: HttpRoutes
) -> type[GatewayConnection]:
    """A `GatewayConnection` class bound to one server's counters and routes (websockets
    builds each connection from a class)."""

    class BoundConnection(GatewayConnection):
        """A `GatewayConnection` counted by this server."""

    BoundConnection.pending = pending
    BoundConnection.metrics = metrics
    BoundConnection.http_routes = http_routes
    return BoundConnection


def _peer_address(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) else str(peer)


def http_response(status: HTTPStatus, body: bytes, content_type: str) -> Response:
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            ("Connection", "close"),
        ]
    )
    return Response(status.value, status.phrase, headers, body)


def error_response(status: HTTPStatus, message: str) -> Response:
    """An answer to a request that never reached the routes."""
    body = json.dumps({"error": message}).encode()
    return http_response(status, body, "application/json")


def not_allowed(allow: str) -> Response:
    response = error_response(HTTPStatus.METHOD_NOT_ALLOWED, "method not allowed")
    response.headers["Allow"] = allow
    return response
