"""The WebSocket server: /v1/realtime, /healthz, /metrics and /web on one port, and
OpenAI's WebRTC endpoints (/v1/realtime/client_secrets, /v1/realtime/calls) beside them.

HTTP routes are answered in the handshake hook (`_process_request`), so plain GETs never
become WebSocket connections. Authentication, the origin allow-list and the session cap
are checked there too, before any session state exists. What comes before the hook
(HEAD, malformed requests, pending handshakes) is `gateway.server.handshake`'s.

Draining (`drain`, on SIGTERM) lets a load balancer take the instance out of rotation:
/healthz answers 503 and new sessions are refused with 503 while the sessions already
open finish their running responses and are closed with 1001; then `shutdown`.

A WebRTC call (`gateway.webrtc.call`, made on `gateway.webrtc.call_routes`) is a session like a
WebSocket's: it counts against `max_sessions`, drains and shuts down with them, and shows
in the same metrics. A WebSocket opened with `?call_id=` is no session of its own: it
joins the call's. What a request carries (its key, its shape, its query) is read by
`gateway.server.request_fields`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import mimetypes
import socket
import time
import weakref
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from gateway.config import GatewayConfig
from gateway.protocol.session_config import TRANSCRIPTION_MODELS
from gateway.server import request_fields
from gateway.server.admission import Admission, AdmittedBackend
from gateway.server.connection import RealtimeConnection
from gateway.server.handshake import (
    GatewayConnection,
    HttpRoutes,
    PendingHandshakes,
    connection_type,
    http_response,
    not_allowed,
)
from gateway.server.metrics import GatewayMetrics
from gateway.server.request_fields import INTENT_TRANSCRIPTION, KEY_COOKIE
from gateway.session.backend import Backend
from gateway.webrtc import calls
from gateway.webrtc.call import CallConnection
from gateway.webrtc.call_routes import CallRoutes

__all__ = ["GatewayServer", "DRAIN_REASON"]

logger = logging.getLogger(__name__)

REALTIME_PROTOCOL = Subprotocol("realtime")
DEFAULT_WEB_ROOT = Path(__file__).resolve().parents[2] / "web"
# Close reasons (at most 123 bytes): a drained session, and one still busy at the timeout.
DRAIN_REASON = "server draining: reconnect to continue"
DRAIN_TIMEOUT_REASON = "server draining: the response did not finish in time; reconnect"


class QuietHealthChecks(logging.Filter):
    """websockets logs every plain GET it answers as "connection rejected (200 OK)" at
    INFO; a load balancer's health checks would fill the log, so those for /healthz are
    logged at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = getattr(getattr(record, "websocket", None), "request", None)
        if record.levelno != logging.INFO or not isinstance(request, Request):
            return True
        if urlsplit(request.path).path != "/healthz":
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


WEBSOCKETS_LOGGER = logging.getLogger("websockets.server")
_QUIET_HEALTH_CHECKS = QuietHealthChecks()


class GatewayServer:
    def __init__(
        self, config: GatewayConfig, backend: Backend, metrics: GatewayMetrics | None = None
    ) -> None:
        self.config = config
        self.backend = backend
        self.metrics = metrics or GatewayMetrics()
        self.metrics.watch_engine(backend.pending)
        self.metrics.watch_prepared(backend.prepared_turns)
        self.metrics.watch_llm_tokens(backend.llm_tokens)
        self.metrics.watch_engine_caches(backend.engine_caches)
        self.admission = Admission(config.capacity, self.metrics)
        self.metrics.watch_capacity(
            lambda: self.admission.speaking,
            lambda: self.admission.queued,
            self.admission.saturated,
        )
        self._admitted = AdmittedBackend(backend, self.admission)
        self.web_root = (config.web_root or DEFAULT_WEB_ROOT).resolve()
        self.connections: set[RealtimeConnection] = set()
        # Idle sessions closing to make room, and the connection each makes room for.
        self._giving_way: set[RealtimeConnection] = set()
        # (Weak: a handshake may still fail after the check, and never reach `_handle`.)
        self._room_from: weakref.WeakKeyDictionary[ServerConnection, RealtimeConnection] = (
            weakref.WeakKeyDictionary()
        )
        self.pending = PendingHandshakes(config.limits)
        self._server: Server | None = None
        self._loop_lag: asyncio.Task[None] | None = None
        self.draining = False
        self._no_sessions = asyncio.Event()
        self._no_sessions.set()
        self._call_routes = CallRoutes(self, config, self.metrics, self.admission, self._admitted)

    @property
    def calls(self) -> dict[str, CallConnection]:
        """The WebRTC calls open now, by id."""
        return self._call_routes.calls

    @property
    def port(self) -> int:
        assert self._server is not None
        socket = next(iter(self._server.sockets))
        port: int = socket.getsockname()[1]
        return port

    async def start(self) -> None:
        WEBSOCKETS_LOGGER.addFilter(_QUIET_HEALTH_CHECKS)  # once: filters are a set
        self._server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=self._process_request,
            select_subprotocol=self._select_subprotocol,
            max_size=self.config.limits.max_frame_bytes,
            # Compression costs CPU on every audio delta for little gain on base64 PCM.
            compression=None,
            server_header="duplex-gateway",
            create_connection=connection_type(
                self.pending, self.metrics, HttpRoutes(self._call_routes.answer, calls.takes_body)
            ),
            open_timeout=self.config.limits.handshake_timeout_s,
            logger=WEBSOCKETS_LOGGER,
        )
        self._loop_lag = asyncio.create_task(self.metrics.sample_loop_lag(), name="loop-lag")
        logger.info("listening on ws://%s:%d/v1/realtime", self.config.host, self.port)

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.wait_closed()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new sessions and fail health checks; close each open session with 1001
        once no response of it is running, and those still busy after `timeout_s`.
        Returns when no session is left; `shutdown` then stops the rest."""
        self.draining = True
        logger.info(
            "draining: %d open sessions, up to %g s for their responses",
            len(self.connections),
            timeout_s,
        )
        for conn in list(self.connections):
            conn.close_when_idle(DRAIN_REASON)
        try:
            await asyncio.wait_for(self._no_sessions.wait(), timeout_s)
        except TimeoutError:
            logger.info("drain timeout: closing %d busy sessions", len(self.connections))
            await self._close_sessions(DRAIN_TIMEOUT_REASON)

    async def _close_sessions(self, reason: str) -> None:
        await asyncio.gather(
            *(conn.shutdown(reason) for conn in list(self.connections)), return_exceptions=True
        )
        await self._no_sessions.wait()

    async def shutdown(self, reason: str = "server shutting down") -> None:
        """Stop accepting, close every session with 1001 and `reason`, stop the engine."""
        if self._server is None:
            return
        if self._loop_lag is not None:
            self._loop_lag.cancel()
            await asyncio.gather(self._loop_lag, return_exceptions=True)
        self.draining = True
        self._server.close(close_connections=False)
        await self._close_sessions(reason)
        await self._server.wait_closed()
        await self.backend.close()

    # -- handshake ----------------------------------------------------------------------

    def _select_subprotocol(
        self, connection: ServerConnection, offered: Sequence[Subprotocol]
    ) -> Subprotocol | None:
        # Browsers require an echo of one offered value; the Python SDK offers none and
        # fails if one comes back. So: `realtime` exactly when offered.
        return REALTIME_PROTOCOL if REALTIME_PROTOCOL in offered else None

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        method = connection.method if isinstance(connection, GatewayConnection) else None
        response = self._route(request, method or "GET")
        if response is None and request_fields.call_id(request) is None:
            # A realtime session, once every other check passed (a sideband is none).
            response = self._check_room(connection)
        if method == "HEAD" and response is not None:
            # What a GET would answer, headers and Content-Length included, less the body.
            return dataclasses.replace(response, body=b"")
        return response

    def _route(self, request: Request, method: str) -> Response | None:
        path = urlsplit(request.path).path
        if path == "/v1/realtime":
            if method != "GET":
                return not_allowed("GET")
            return self._check_realtime(request)
        if path == "/healthz":
            # 503 while draining, so that a load balancer stops routing here.
            status = HTTPStatus.SERVICE_UNAVAILABLE if self.draining else HTTPStatus.OK
            return self._json(status, self._health())
        if path == "/metrics" or path == "/web" or path.startswith("/web/"):
            refused = self._check_http_key(request)
            if refused is not None:
                return refused
        if path == "/metrics":
            return http_response(HTTPStatus.OK, self.metrics.render(), "text/plain; version=0.0.4")
        if path == "/web" or path.startswith("/web/"):
            response = self._static(path[len("/web") :])
            if self.config.api_key is not None and response.status_code == HTTPStatus.OK:
                # The page's own scripts and its WebSocket come back with this cookie.
                response.headers["Set-Cookie"] = (
                    f"{KEY_COOKIE}={self.config.api_key}; Path=/; HttpOnly; SameSite=Strict"
                )
            return response
        if path == "/":
            return _redirect("/web/")
        return self._json(HTTPStatus.NOT_FOUND, {"error": f"no route {path}"})

    def _check_http_key(self, request: Request) -> Response | None:
        """/metrics and /web take the key as a Bearer header, `?api_key=` or the cookie."""
        expected = self.config.api_key
        if expected is None:
            return None
        given = (
            request_fields.api_key(request)
            or request_fields.query_key(request)
            or request_fields.cookie_key(request)
        )
        if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
            return self._refuse(
                HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or invalid API key"
            )
        return None

    def _check_realtime(self, request: Request) -> Response | None:
        origin = request.headers.get("Origin")
        if self.config.allowed_origins and origin and origin not in self.config.allowed_origins:
            return self._refuse(HTTPStatus.FORBIDDEN, "origin_not_allowed", "origin not allowed")
        expected = self.config.api_key
        if expected is not None:
            given = request_fields.api_key(request)
            if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
                return self._refuse(
                    HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or invalid API key"
                )
        intent = request_fields.intent(request)
        if intent not in (None, INTENT_TRANSCRIPTION):
            return self._refuse(
                HTTPStatus.BAD_REQUEST,
                "invalid_intent",
                f"unknown intent {intent!r}; the one intent is "
                f"{INTENT_TRANSCRIPTION!r} (a transcription session)",
            )
        call_id = request_fields.call_id(request)
        if call_id is not None and call_id not in self.calls:
            return self._refuse(HTTPStatus.NOT_FOUND, "call_not_found", f"no call {call_id!r}")
        if self.draining and call_id is None:
            return self._refuse(
                HTTPStatus.SERVICE_UNAVAILABLE, "server_draining", "server draining; try another"
            )
        return None

    def _check_room(self, connection: ServerConnection) -> Response | None:
        """At `max_sessions`, the session idle longest gives way (`idle_session_s`);
        else the connection is refused."""
        if len(self.connections) - len(self._giving_way) < self.config.max_sessions:
            return None
        idlest = self._idlest()
        if idlest is None:
            return self._refuse(
                HTTPStatus.SERVICE_UNAVAILABLE, "too_many_sessions", "too many open sessions"
            )
        logger.info("session %s gives way to a new connection", idlest.session_id)
        self.metrics.idle_closed.inc()
        self._giving_way.add(idlest)
        self._room_from[connection] = idlest
        idlest.close_idle()
        return None

    def _idlest(self) -> RealtimeConnection | None:
        limit = self.config.idle_session_s
        if limit is None:
            return None
        now = time.monotonic()
        candidates = [c for c in self.connections if c not in self._giving_way]
        idlest = max(candidates, key=lambda c: c.idle_for(now), default=None)
        return idlest if idlest is not None and idlest.idle_for(now) >= limit else None

    def _refuse(self, status: HTTPStatus, code: str, message: str) -> Response:
        self.metrics.rejected.labels(code).inc()
        error = {"type": "invalid_request_error", "code": code, "message": message}
        return self._json(status, {"error": error})

    def _json(self, status: HTTPStatus, payload: object) -> Response:
        return http_response(status, json.dumps(payload).encode(), "application/json")

    def _health(self) -> dict[str, object]:
        return {
            "status": "draining" if self.draining else "ok",
            "instance": self.config.instance or f"{socket.gethostname()}:{self.port}",
            "sessions": len(self.connections),
            "max_sessions": self.config.max_sessions,
            "model": self.config.model_name,
            "models": list(self.config.served_models),
            # Load balancers: a saturated instance serves its sessions but new spoken
            # responses wait or are refused (docs/deploy.md, "Health checks").
            "saturated": self.admission.saturated(),
            "speaking": self.admission.speaking,
            "queued": self.admission.queued,
            "capacity": self.config.capacity.model_dump(),
        }

    def _static(self, rel: str) -> Response:
        rel = rel.lstrip("/") or "index.html"
        not_found = self._json(HTTPStatus.NOT_FOUND, {"error": "not found"})
        try:
            target = (self.web_root / rel).resolve()
            # Resolving first defeats `..`, encoded or not, and symlinks out of the root.
            if not target.is_relative_to(self.web_root) or not target.is_file():
                return not_found
            body = target.read_bytes()
        except (OSError, ValueError) as exc:
            # A name the file system refuses (too long, a NUL byte) names no file here.
            logger.debug("cannot serve /web/%.80s: %s", rel, exc)
            return not_found
        kind = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        if kind in ("text/javascript", "application/javascript"):
            kind = "text/javascript; charset=utf-8"
        return http_response(HTTPStatus.OK, body, kind)

    # -- sessions -----------------------------------------------------------------------

    async def _handle(self, websocket: ServerConnection) -> None:
        request = websocket.request
        assert request is not None
        call_id = request_fields.call_id(request)
        if call_id is not None:
            call = self.calls.get(call_id)
            if call is not None:  # else it ended since the handshake: close at once
                await call.join(websocket)
            return
        giving_way = self._room_from.pop(websocket, None)
        if giving_way is not None:
            # Its engine session frees its slot as it closes, which is quick: it is idle.
            await giving_way.released.wait()
        query = parse_qs(urlsplit(request.path).query)
        model = (query.get("model") or [self.config.model_name])[0]
        conn = RealtimeConnection(
            websocket,
            self._admitted,
            self.config,
            self.metrics,
            model=model,
            beta=request_fields.is_beta(request),
            rate_limits=self.admission.rate_limits,
        )
        transcribing = request_fields.intent(request) == INTENT_TRANSCRIPTION
        if transcribing:
            conn.core.open_as_transcription()
        # A transcription session may be named by the transcription model it asks for.
        if not (self.config.serves(model) or transcribing and model in TRANSCRIPTION_MODELS):
            conn.core.reject_model(model, self.config.model_name)
        await self.serve(conn)

    async def serve(self, conn: RealtimeConnection) -> None:
        """Run a session, counted among the open ones until it ends."""
        self.connections.add(conn)
        self._no_sessions.clear()
        if self.draining:  # its handshake was accepted just before the drain began
            conn.close_when_idle(DRAIN_REASON)
        self.metrics.sessions.inc()
        self.metrics.sessions_total.inc()
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
            self._giving_way.discard(conn)
            self.metrics.sessions.dec()
            if not self.connections:
                self._no_sessions.set()

    async def make_room_for_call(self, answering: int) -> None:
        """A call takes a session's place as a WebSocket does (`_check_room`); the
        `answering` calls admitted before it hold theirs while their answers are made."""
        open_now = len(self.connections) + answering - len(self._giving_way)
        if open_now < self.config.max_sessions:
            return
        idlest = self._idlest()
        if idlest is None:
            raise calls.CallError(
                HTTPStatus.SERVICE_UNAVAILABLE, "too_many_sessions", "too many open sessions"
            )
        logger.info("session %s gives way to a new call", idlest.session_id)
        self.metrics.idle_closed.inc()
        self._giving_way.add(idlest)
        idlest.close_idle()
        await idlest.released.wait()


def _redirect(location: str) -> Response:
    headers = Headers([("Location", location), ("Content-Length", "0"), ("Connection", "close")])
    return Response(HTTPStatus.FOUND.value, HTTPStatus.FOUND.phrase, headers, b"")
