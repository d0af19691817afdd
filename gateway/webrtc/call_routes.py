"""The server's WebRTC routes: POST and OPTIONS on OpenAI's endpoints, whose forms,
CORS headers and SDP answer are `gateway.webrtc.calls`'.

A client secret is minted with the real key, its session config checked as a call
would apply it. A call is made with a live client secret (the SDP form only) or the real
key; it takes a session's place as a WebSocket does, and once answered the server runs
it among its sessions (`CallHost`). A call is hung up with the key it was made with, or
the real one.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from http import HTTPStatus
from typing import Any, Protocol

from websockets.http11 import Response

from gateway.config import GatewayConfig
from gateway.protocol.audio import MEDIA_PCM
from gateway.protocol.errors import ClientError
from gateway.protocol.events import new_id
from gateway.protocol.session_object import ga_session_object
from gateway.server.admission import Admission, AdmittedBackend
from gateway.server.connection import RealtimeConnection
from gateway.server.handshake import http_response
from gateway.server.http_requests import HttpRequest
from gateway.server.metrics import GatewayMetrics
from gateway.session.realtime import RealtimeSession
from gateway.webrtc import calls
from gateway.webrtc.call import CallConnection
from gateway.webrtc.client_secrets import (
    ClientSecret,
    ClientSecrets,
    SecretError,
    is_ephemeral,
    parse_mint_request,
)

__all__ = ["CallHost", "CallRoutes"]


class CallHost(Protocol):
    """What the routes need of the server: whether it drains, the sessions it counts,
    room for one more, and the running of a session among the open ones."""

    draining: bool
    connections: set[RealtimeConnection]

    async def make_room_for_call(self, answering: int) -> None: ...

    async def serve(self, conn: RealtimeConnection) -> None: ...


class CallRoutes:
    def __init__(
        self,
        host: CallHost,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        admission: Admission,
        admitted: AdmittedBackend,
    ) -> None:
        self._host = host
        self.config = config
        self.metrics = metrics
        self._admission = admission
        self._admitted = admitted
        self.secrets = ClientSecrets()
        self.calls: dict[str, CallConnection] = {}
        self._call_tasks: set[asyncio.Task[None]] = set()
        self._answering = 0  # calls admitted, their answers not yet made

    async def answer(self, request: HttpRequest) -> Response:
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
            "session": ga_session_object(probe.settings),
        }
        return http_response(HTTPStatus.OK, json.dumps(answer).encode(), "application/json")

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
        if self._host.draining:
            raise calls.CallError(
                HTTPStatus.SERVICE_UNAVAILABLE, "server_draining", "server draining; try another"
            )
        session = {**(secret.session if secret else {}), **(offer.session or {})}
        self._call_core(session)  # refused before any peer connection exists
        await self._host.make_room_for_call(self._answering)
        call_id = new_id("rtc")
        peer = calls.new_peer(self.config.ice_servers)
        conn = CallConnection(
            call_id,
            peer,
            self._admitted,
            self.config,
            self.metrics,
            model=self.config.model_name,
            rate_limits=self._admission.rate_limits,
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
        # Counted from now: the server's `serve` starts on the next step.
        self._host.connections.add(conn)
        task = asyncio.create_task(self._serve_call(conn), name=f"call-{call_id}")
        self._call_tasks.add(task)
        task.add_done_callback(self._call_tasks.discard)
        response = http_response(HTTPStatus.CREATED, answer.encode(), "application/sdp")
        response.headers["Location"] = calls.call_location(call_id)
        return response

    async def _serve_call(self, conn: CallConnection) -> None:
        try:
            await self._host.serve(conn)
        finally:
            self.calls.pop(conn.call_id, None)

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
