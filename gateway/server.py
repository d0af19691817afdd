"""The WebSocket server: /v1/realtime, /healthz, /metrics and /web on one port, and
OpenAI's WebRTC endpoints (/v1/realtime/client_secrets, /v1/realtime/calls) beside them.

HTTP routes are answered in the handshake hook (`_process_request`), so plain GETs never
become WebSocket connections. Authentication, the origin allow-list and the session cap
are checked there too, before any session state exists. What comes before the hook
(HEAD, malformed requests, pending handshakes) is `gateway.handshake`'s.

Draining (`drain`, on SIGTERM) lets a load balancer take the instance out of rotation:
/healthz answers 503 and new sessions are refused with 503 while the sessions already
open finish their running responses and are closed with 1001; then `shutdown`.

A WebRTC call (`gateway.call`) is a session like a WebSocket's: it counts against
`max_sessions`, drains and shuts down with them, and shows in the same metrics. A
WebSocket opened with `?call_id=` is no session of its own: it joins the call's.
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
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from gateway import calls
from gateway.admission import Admission, AdmittedBackend
from gateway.audio import MEDIA_PCM
from gateway.backend import Backend
from gateway.call import CallConnection
from gateway.client_secrets import (
    ClientSecret,
    ClientSecrets,
    SecretError,
    is_ephemeral,
    parse_mint_request,
)
from gateway.config import GatewayConfig
from gateway.connection import RealtimeConnection
from gateway.errors import ClientError
from gateway.handshake import (
    GatewayConnection,
    HttpRoutes,
    PendingHandshakes,
    connection_type,
    http_response,
    not_allowed,
)
from gateway.http_requests import HttpRequest
from gateway.metrics import GatewayMetrics
from gateway.protocol import new_id
from gateway.realtime import RealtimeSession
from gateway.session_config import TRANSCRIPTION_MODELS

__all__ = ["GatewayServer", "KEY_PROTOCOL_PREFIX", "BETA_PROTOCOL", "DRAIN_REASON"]

logger = logging.getLogger(__name__)

KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."
KEY_COOKIE = "duplex_gateway_key"
BETA_PROTOCOL = "openai-beta.realtime-v1"
REALTIME_PROTOCOL = Subprotocol("realtime")
INTENT_TRANSCRIPTION = "transcription"  # ?intent=transcription: a transcription session
DEFAULT_WEB_ROOT = Path(__file__).resolve().parent.parent / "web"
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


def _offered_protocols(request: Request) -> list[str]:
    values = request.headers.get_all("Sec-WebSocket-Protocol")
    return [p.strip() for value in values for p in value.split(",") if p.strip()]


def is_beta(request: Request) -> bool:
    header = request.headers.get("OpenAI-Beta", "")
    return "realtime=v1" in header.replace(" ", "") or BETA_PROTOCOL in _offered_protocols(request)


def _intent(request: Request) -> str | None:
    """`?intent=`: "transcription" asks for a transcription session."""
    values = parse_qs(urlsplit(request.path).query).get("intent")
    return values[0] if values else None


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    for proto in _offered_protocols(request):
        if proto.startswith(KEY_PROTOCOL_PREFIX):
            return proto[len(KEY_PROTOCOL_PREFIX) :]
    return None


def _call_id(request: Request) -> str | None:
    """`?call_id=`: a sideband WebSocket, joining that call's session."""
    values = parse_qs(urlsplit(request.path).query).get("call_id")
    return values[0] if values else None


def _query_key(request: Request) -> str | None:
    values = parse_qs(urlsplit(request.path).query).get("api_key")
    return values[0] if values else None


def _cookie_key(request: Request) -> str | None:
    cookies = SimpleCookie()
    try:
        cookies.load(request.headers.get("Cookie", ""))
    except CookieError:
        return None
    morsel = cookies.get(KEY_COOKIE)
    return morsel.value if morsel is not None else None


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
        self.secrets = ClientSecrets()
        self.calls: dict[str, CallConnection] = {}
        self._call_tasks: set[asyncio.Task[None]] = set()
        self._answering = 0  # calls admitted, their answers not yet made

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
                self.pending, self.metrics, HttpRoutes(self._http, calls.takes_body)
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
        if response is None and _call_id(request) is None:
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
        given = _api_key(request) or _query_key(request) or _cookie_key(request)
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
            given = _api_key(request)
            if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
                return self._refuse(
                    HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or invalid API key"
                )
        intent = _intent(request)
        if intent not in (None, INTENT_TRANSCRIPTION):
            return self._refuse(
                HTTPStatus.BAD_REQUEST,
                "invalid_intent",
                f"unknown intent {intent!r}; the one intent is "
                f"{INTENT_TRANSCRIPTION!r} (a transcription session)",
            )
        call_id = _call_id(request)
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
        call_id = _call_id(request)
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
            beta=is_beta(request),
            rate_limits=self.admission.rate_limits,
        )
        transcribing = _intent(request) == INTENT_TRANSCRIPTION
        if transcribing:
            conn.core.open_as_transcription()
        # A transcription session may be named by the transcription model it asks for.
        if not (self.config.serves(model) or transcribing and model in TRANSCRIPTION_MODELS):
            conn.core.reject_model(model, self.config.model_name)
        await self._serve(conn)

    async def _serve(self, conn: RealtimeConnection) -> None:
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

    # -- WebRTC: client secrets and calls -----------------------------------------------

    async def _http(self, request: HttpRequest) -> Response:
        """POST and OPTIONS on the routes `calls.takes_body` names."""
        origin = request.headers.get("Origin")
        if self.config.allowed_origins and origin and origin not in self.config.allowed_origins:
            self.metrics.rejected.labels("origin_not_allowed").inc()
            return calls.error_answer(
                HTTPStatus.FORBIDDEN, "origin_not_allowed", "origin not allowed"
            )
        if request.method == "OPTIONS":
            response = http_response(HTTPStatus.NO_CONTENT, b"", "text/plain")
        else:
            try:
                response = await self._post(request)
            except calls.CallError as exc:
                self.metrics.rejected.labels(exc.code).inc()
                response = calls.error_answer(exc.status, exc.code, str(exc), exc.param)
        for name, value in calls.cors_headers(origin):
            response.headers[name] = value
        return response

    async def _post(self, request: HttpRequest) -> Response:
        path = request.path
        if path == calls.CLIENT_SECRETS_PATH:
            return self._mint(request)
        if path == calls.CALLS_PATH:
            return await self._create_call(request)
        call_id = calls.hangup_call_id(path)
        assert call_id is not None  # `takes_body` admits no other path
        return self._hang_up(request, call_id)

    def _real_key(self, request: HttpRequest) -> str | None:
        auth = request.headers.get("Authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _check_real_key(self, given: str | None) -> None:
        expected = self.config.api_key
        if expected is None:
            return
        if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
            raise calls.CallError(
                HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or invalid API key"
            )

    def _check_call_key(self, request: HttpRequest, *, unified: bool) -> ClientSecret | None:
        """The key a call is made with: a live client secret (the SDP form only), or the
        real key. An `ek_` key is never taken for the real one."""
        given = self._real_key(request)
        if given is not None and is_ephemeral(given):
            secret = self.secrets.find(given)
            if secret is None or unified:
                message = (
                    "the unified form takes the real API key"
                    if unified and secret is not None
                    else "the client secret is unknown or expired"
                )
                raise calls.CallError(HTTPStatus.UNAUTHORIZED, "invalid_api_key", message)
            return secret
        self._check_real_key(given)
        return None

    def _mint(self, request: HttpRequest) -> Response:
        self._check_real_key(self._real_key(request))
        try:
            body = json.loads(request.body or b"{}")
            mint = parse_mint_request(body)
        except ValueError as exc:
            code = exc.code if isinstance(exc, SecretError) else "invalid_json"
            param = exc.param if isinstance(exc, SecretError) else None
            raise calls.CallError(HTTPStatus.BAD_REQUEST, code, str(exc), param) from None
        # The config is checked as a call would apply it, by the same session core.
        probe = self._call_core(mint.session)
        try:
            secret = self.secrets.mint(mint)
        except SecretError as exc:
            raise calls.CallError(
                HTTPStatus.TOO_MANY_REQUESTS, exc.code, str(exc), exc.param
            ) from None
        answer = {
            "value": secret.value,
            "expires_at": secret.expires_at,
            "session": probe.settings.ga_object(),
        }
        return self._json(HTTPStatus.OK, answer)

    def _call_core(self, session: dict[str, Any] | None) -> RealtimeSession:
        """A call's session core with `session` applied; raises CallError if refused."""
        core = RealtimeSession(
            config=self.config, model=self.config.model_name, beta=False, media_format=MEDIA_PCM
        )
        if session:
            try:
                core.start_with(session)
            except ClientError as exc:
                raise calls.CallError(
                    HTTPStatus.BAD_REQUEST, exc.code, str(exc), exc.param
                ) from None
        return core

    async def _create_call(self, request: HttpRequest) -> Response:
        offer = calls.parse_offer(request)
        secret = self._check_call_key(request, unified=offer.unified)
        if self.draining:
            raise calls.CallError(
                HTTPStatus.SERVICE_UNAVAILABLE, "server_draining", "server draining; try another"
            )
        session = {**(secret.session if secret else {}), **(offer.session or {})}
        self._call_core(session)  # refused before any peer connection exists
        await self._make_room()
        call_id = new_id("rtc")
        peer = calls.new_peer(self.config.ice_servers)
        conn = CallConnection(
            call_id,
            peer,
            self._admitted,
            self.config,
            self.metrics,
            model=self.config.model_name,
            rate_limits=self.admission.rate_limits,
            made_with=secret.value if secret else None,
        )
        if session:
            conn.core.start_with(session)
        self._answering += 1  # holds its place while its answer is made
        try:
            answer = await calls.answer_offer(peer, offer.sdp, conn.track)
        except BaseException:
            await conn.abandon()
            raise
        finally:
            self._answering -= 1
        self.calls[call_id] = conn
        self.connections.add(conn)  # counted from now: `_serve` starts on the next step
        task = asyncio.create_task(self._serve_call(conn), name=f"call-{call_id}")
        self._call_tasks.add(task)
        task.add_done_callback(self._call_tasks.discard)
        response = http_response(HTTPStatus.CREATED, answer.encode(), "application/sdp")
        response.headers["Location"] = calls.call_location(call_id)
        return response

    async def _serve_call(self, conn: CallConnection) -> None:
        try:
            await self._serve(conn)
        finally:
            self.calls.pop(conn.call_id, None)

    async def _make_room(self) -> None:
        """A call takes a session's place as a WebSocket does (`_check_room`)."""
        open_now = len(self.connections) + self._answering - len(self._giving_way)
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

    def _hang_up(self, request: HttpRequest, call_id: str) -> Response:
        call = self.calls.get(call_id)
        given = self._real_key(request)
        made_with = call.made_with if call is not None else None
        if not (given is not None and made_with is not None and given == made_with):
            self._check_real_key(given)
        if call is None:
            raise calls.CallError(HTTPStatus.NOT_FOUND, "call_not_found", f"no call {call_id!r}")
        call.hang_up()
        return http_response(HTTPStatus.OK, b"", "text/plain")


def _redirect(location: str) -> Response:
    headers = Headers([("Location", location), ("Content-Length", "0"), ("Connection", "close")])
    return Response(HTTPStatus.FOUND.value, HTTPStatus.FOUND.phrase, headers, b"")
