"""The WebSocket server and connection shell over a scripted engine (fast, no models).

The fake engine speaks fixed replies and detects speech by signal energy through the
real `SpeechDetector`, so every protocol path runs over a real socket in milliseconds.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Origin, Subprotocol

from duplex.turn import Stage, TurnRequest
from engine.listening.speech_detector import (
    SpeechDetector,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
)
from gateway.config import GatewayConfig
from gateway.protocol.session_config import TurnDetection
from gateway.server.server import GatewayServer
from gateway.session.backend import ResponseDone, ResponseOutput, SpeechDecision
from tests.fake_backend import IdleBackend, Reply, ScriptedSession

INPUT_RATE = 24000  # the client's PCM16
OUTPUT_RATE = 22050  # the fake engine's speech, as float32 like the real one
USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "cached_tokens": 0}


def speaks(words: list[str], chunk_ms: int, delay: float) -> Reply:
    """Replies with `words`: one text delta and (for a spoken reply) one `chunk_ms` audio
    chunk per word, `delay` seconds of compute apart."""

    async def reply(session: ScriptedSession, response_id: str, turn: TurnRequest) -> None:
        if turn.entry is Stage.ASR:
            session.put(ResponseOutput(response_id, "transcript", text="fake transcript"))
        if turn.final is not Stage.ASR:
            for word in words:
                await asyncio.sleep(delay)
                session.put(ResponseOutput(response_id, "text", text=word + " "))
                if turn.final is Stage.TTS:
                    session.put(speech(response_id, word, chunk_ms))
        session.put(ResponseDone(response_id, "completed", usage=USAGE))

    return reply


def speech(response_id: str, word: str, chunk_ms: int) -> ResponseOutput:
    samples = np.full(OUTPUT_RATE * chunk_ms // 1000, 0.1, dtype="<f4")
    return ResponseOutput(
        response_id, "audio", text=word, audio=samples.tobytes(), sample_rate=OUTPUT_RATE
    )


class EnergySpeech:
    """Server VAD stand-in: a 32 ms chunk is speech when its RMS exceeds 0.05. Speech
    over an answer interrupts at once here (no minimum to confirm)."""

    def __init__(self, emit: Callable[[SpeechDecision], None]) -> None:
        self.emit = emit
        self.detector: SpeechDetector | None = None
        self.start_ms = 0.0
        self.pending = np.zeros(0, np.float32)

    def configure(
        self, settings: TurnDetection | None, start_ms: float, pause_after_ms: int | None = None
    ) -> None:
        self.pending = np.zeros(0, np.float32)
        self.start_ms = start_ms
        self.detector = None
        if settings is not None:
            self.detector = SpeechDetector(
                settings.threshold,
                settings.prefix_padding_ms,
                settings.silence_duration_ms,
                pause_after_ms=pause_after_ms,
            )

    def feed(self, samples: np.ndarray) -> None:
        if self.detector is None:
            return
        self.pending = np.concatenate([self.pending, samples])
        n = len(self.pending) // 512
        chunks = self.pending[: n * 512].reshape(n, 512)
        self.pending = self.pending[n * 512 :]
        probs = (np.sqrt((chunks**2).mean(axis=1)) > 0.05).astype(np.float32)
        for d in self.detector.push(probs):
            if isinstance(d, SpeechStarted):
                event = SpeechDecision("started", self.start_ms + d.audio_start_ms)
            elif isinstance(d, SpeechPaused):
                event = SpeechDecision("paused", self.start_ms + d.audio_end_ms)
            elif isinstance(d, SpeechResumed):
                event = SpeechDecision("resumed", self.start_ms + d.detected_ms)
            else:
                event = SpeechDecision("stopped", self.start_ms + d.audio_end_ms)
            self.emit(event)


class FakeBackend(IdleBackend):
    def __init__(
        self, words: list[str] | None = None, chunk_ms: int = 200, delay: float = 0.005
    ) -> None:
        super().__init__()
        self.models = ["duplex-smollm2"]
        self.words = words or ["Hello", "there", "friend"]
        self.chunk_ms = chunk_ms
        self.delay = delay
        self.sessions: list[ScriptedSession] = []
        self.session_closed = asyncio.Event()  # set once any session is released

    def open_session(self, session_id: str) -> ScriptedSession:
        reply = speaks(self.words, self.chunk_ms, self.delay)
        session = ScriptedSession(reply, closed=self.session_closed)
        session.speech = EnergySpeech(session.put)
        self.sessions.append(session)
        return session


async def start_server(backend: FakeBackend | None = None, **config: Any) -> GatewayServer:
    server = GatewayServer(GatewayConfig(port=0, **config), backend or FakeBackend())
    await server.start()
    return server


def url(server: GatewayServer, path: str = "/v1/realtime?model=duplex-smollm2") -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


async def recv(ws: ClientConnection, until: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Events up to and including the first of type `until`."""
    events = []
    async with asyncio.timeout(timeout):
        while True:
            event = json.loads(await ws.recv())
            events.append(event)
            if event["type"] == until:
                return events


def speech_b64(ms: int, loud: bool) -> str:
    t = np.arange(INPUT_RATE * ms // 1000) / INPUT_RATE
    x = (0.3 if loud else 0.0) * np.sin(2 * np.pi * 200 * t)
    return base64.b64encode((x * 32767).astype("<i2").tobytes()).decode()


def http_get(server: GatewayServer, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def test_http_routes_and_static_files_without_traversal() -> None:
    server = await start_server()
    try:
        status, body = await asyncio.to_thread(http_get, server, "/healthz")
        health = json.loads(body)
        assert status == 200 and health["status"] == "ok"
        assert health["sessions"] == 0 and health["max_sessions"] == 48
        assert (health["saturated"], health["speaking"], health["queued"]) == (False, 0, 0)
        assert health["capacity"] == {
            "max_speaking": 4,
            "runway_floor_s": 0.5,
            "max_queued": 8,
            "max_wait_s": 3.0,
        }
        status, body = await asyncio.to_thread(http_get, server, "/metrics")
        assert status == 200 and b"duplex_gateway_open_sessions" in body
        for name in (b"duplex_gateway_playback_runway_seconds", b"duplex_gateway_saturated"):
            assert name in body
        status, body = await asyncio.to_thread(http_get, server, "/web/")
        assert status == 200 and b"<html" in body.lower()
        for bad in (
            "/web/../pyproject.toml",
            "/web/%2e%2e/pyproject.toml",
            "/web/..%2fREADME.md",
            "/web//etc/passwd",
            "/nope",
        ):
            status, _ = await asyncio.to_thread(http_get, server, bad)
            assert status == 404, bad
    finally:
        await server.shutdown()


def raw_http(port: int, request: bytes, source: str = "127.0.0.1") -> bytes:
    """Send `request` byte for byte and read the whole answer (empty if none came)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def parse_answer(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one HTTP response."""
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


async def ask(server: GatewayServer, request: str | bytes) -> tuple[int, dict[str, str], bytes]:
    raw = request.encode() if isinstance(request, str) else request
    data = await asyncio.to_thread(raw_http, server.port, raw)
    assert data, "the server closed without an answer"
    return parse_answer(data)


def assert_no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


async def test_head_answers_like_get_without_a_body(caplog: pytest.LogCaptureFixture) -> None:
    server = await start_server()
    try:
        for path in ("/healthz", "/web/", "/web/index.html", "/metrics", "/web/missing.js"):
            get_status, get_headers, get_body = await ask(server, f"GET {path} HTTP/1.1\r\n\r\n")
            status, headers, body = await ask(server, f"HEAD {path} HTTP/1.1\r\n\r\n")
            assert status == get_status and body == b"", path
            assert headers["content-type"] == get_headers["content-type"], path
            assert int(headers["content-length"]) == len(get_body), path
        assert_no_tracebacks(caplog)
    finally:
        await server.shutdown()


async def test_other_methods_get_405_with_allow(caplog: pytest.LogCaptureFixture) -> None:
    server = await start_server()
    try:
        for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH"):
            request = f"{method} /healthz HTTP/1.1\r\nContent-Length: 2\r\n\r\n{{}}"
            status, headers, _ = await ask(server, request)
            assert status == 405 and headers["allow"] == "GET, HEAD", method
        status, headers, _ = await ask(server, "HEAD /v1/realtime HTTP/1.1\r\n\r\n")
        assert status == 405 and headers["allow"] == "GET"
        assert_no_tracebacks(caplog)
    finally:
        await server.shutdown()


async def test_paths_that_cannot_be_served_are_404(caplog: pytest.LogCaptureFixture) -> None:
    server = await start_server()
    try:
        for path in ("/web/" + "a" * 300, "/web/" + "a/" * 3000, "/web/a\x00b", "/web/\xff"):
            request = f"GET {path} HTTP/1.1\r\n\r\n".encode("latin-1")
            status, _, _ = await ask(server, request)
            assert status == 404, path[:40]
        assert_no_tracebacks(caplog)
    finally:
        await server.shutdown()


async def test_over_long_request_line_and_headers(caplog: pytest.LogCaptureFixture) -> None:
    server = await start_server()
    try:
        status, _, _ = await ask(server, f"GET /web/{'a' * 9000} HTTP/1.1\r\n\r\n")
        assert status == 414
        status, _, _ = await ask(server, f"GET /healthz HTTP/1.1\r\nX-Big: {'b' * 9000}\r\n\r\n")
        assert status == 431
        many = "".join(f"X-H{i}: v\r\n" for i in range(200))
        status, _, _ = await ask(server, f"GET /healthz HTTP/1.1\r\n{many}\r\n")
        assert status == 431
        status, _, _ = await ask(server, "GET /healthz HTTP/1.0\r\n\r\n")
        assert status == 400
        assert_no_tracebacks(caplog)
    finally:
        await server.shutdown()


def open_pending(port: int, source: str) -> socket.socket:
    """A connection that has sent only part of its request, as a slow or hostile client."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    return s


def answer_without_asking(port: int, source: str) -> bytes:
    """What the server sends to a new connection before it has sent anything."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


async def test_pending_handshakes_are_bounded_per_address_and_per_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limits = {"max_pending_handshakes": 3, "max_pending_handshakes_per_address": 2}
    server = await start_server(limits=limits)
    held: list[socket.socket] = []
    try:
        held += [open_pending(server.port, "127.0.0.1") for _ in range(2)]
        data = await asyncio.to_thread(answer_without_asking, server.port, "127.0.0.1")
        assert parse_answer(data)[0] == 503
        # Another address still gets in, up to the process-wide bound.
        status, _, _ = await asyncio.to_thread(
            lambda: parse_answer(
                raw_http(server.port, b"GET /healthz HTTP/1.1\r\n\r\n", "127.0.0.2")
            )
        )
        assert status == 200
        held.append(open_pending(server.port, "127.0.0.2"))
        data = await asyncio.to_thread(answer_without_asking, server.port, "127.0.0.3")
        assert parse_answer(data)[0] == 503
        # A pending connection that completes its request is answered and frees its place.
        held[0].sendall(b"\r\n")
        assert parse_answer(await asyncio.to_thread(held[0].recv, 65536))[0] == 200
        async with asyncio.timeout(5):
            while (await ask(server, "GET /healthz HTTP/1.1\r\n\r\n"))[0] != 200:
                await asyncio.sleep(0.01)
        assert_no_tracebacks(caplog)
    finally:
        for s in held:
            s.close()
        await server.shutdown()


async def test_a_handshake_that_never_completes_is_closed_after_its_timeout() -> None:
    server = await start_server(limits={"handshake_timeout_s": 0.2})
    try:
        s = await asyncio.to_thread(open_pending, server.port, "127.0.0.1")
        with s:
            assert await asyncio.to_thread(s.recv, 65536) == b""
    finally:
        await server.shutdown()


async def test_auth_subprotocol_echo_and_beta_detection() -> None:
    server = await start_server(api_key="secret")
    try:
        with pytest.raises(InvalidStatus) as info:
            async with connect(url(server)):
                pass
        assert info.value.response.status_code == 401
        with pytest.raises(InvalidStatus):
            async with connect(url(server), additional_headers={"Authorization": "Bearer bad"}):
                pass
        # The SDK's way: a Bearer header and no subprotocol; none must come back.
        async with connect(
            url(server), additional_headers={"Authorization": "Bearer secret"}
        ) as ws:
            assert ws.subprotocol is None
            event = json.loads(await ws.recv())
            assert event["type"] == "session.created" and event["session"]["type"] == "realtime"
        # The browser's way: key and beta flag as subprotocols; `realtime` is echoed.
        protocols = [
            Subprotocol(p)
            for p in ("realtime", "openai-insecure-api-key.secret", "openai-beta.realtime-v1")
        ]
        async with connect(url(server), subprotocols=protocols) as ws:
            assert ws.subprotocol == "realtime"
            event = json.loads(await ws.recv())
            assert "modalities" in event["session"]  # beta shape
        async with connect(
            url(server),
            additional_headers={"Authorization": "Bearer secret", "OpenAI-Beta": "realtime=v1"},
        ) as ws:
            assert "input_audio_format" in json.loads(await ws.recv())["session"]
    finally:
        await server.shutdown()


async def test_origin_allow_list_and_session_cap() -> None:
    server = await start_server(allowed_origins=("http://good.example",), max_sessions=1)
    try:
        with pytest.raises(InvalidStatus) as info:
            async with connect(url(server), origin=Origin("http://evil.example")):
                pass
        assert info.value.response.status_code == 403
        async with connect(url(server), origin=Origin("http://good.example")) as ws:
            await ws.recv()
            with pytest.raises(InvalidStatus) as info:
                async with connect(url(server)):
                    pass
            assert info.value.response.status_code == 503
    finally:
        await server.shutdown()


async def test_unknown_model_is_an_error_then_close() -> None:
    server = await start_server()
    try:
        async with connect(url(server, "/v1/realtime?model=gpt-4o")) as ws:
            event = json.loads(await ws.recv())
            assert event["type"] == "error" and event["error"]["code"] == "invalid_model"
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1008
    finally:
        await server.shutdown()


async def test_text_turn_and_errors_over_the_socket() -> None:
    backend = FakeBackend()
    server = await start_server(backend)
    try:
        async with connect(url(server)) as ws:
            await ws.recv()
            await ws.send(b"\x00\x01")
            assert json.loads(await ws.recv())["error"]["code"] == "invalid_event"
            await ws.send("{oops")
            assert json.loads(await ws.recv())["error"]["code"] == "invalid_json"
            await ws.send(
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {"type": "realtime", "output_modalities": ["text"]},
                    }
                )
            )
            await recv(ws, "session.updated")
            await ws.send(
                json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "hi"}],
                        },
                    }
                )
            )
            await ws.send(json.dumps({"type": "response.create"}))
            await ws.send(json.dumps({"type": "response.create", "event_id": "dup"}))
            events = await recv(ws, "response.done")
            errors = [e for e in events if e["type"] == "error"]
            assert errors[0]["error"]["code"] == "conversation_already_has_active_response"
            assert errors[0]["error"]["event_id"] == "dup"
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text == "Hello there friend "
            assert events[-1]["response"]["usage"]["total_tokens"] == 9
            (turn,) = backend.sessions[0].turns.values()
            assert turn.text == "hi" and turn.final is Stage.LLM
    finally:
        await server.shutdown()


async def test_rate_limits_after_each_response_and_a_trace_line_per_response(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = await start_server(capacity={"max_speaking": 3})
    caplog.set_level(logging.INFO, logger="gateway.trace")
    try:
        async with connect(url(server)) as ws:
            await ws.recv()
            session = {
                "type": "realtime",
                "output_modalities": ["text"],
                "tracing": {"workflow_name": "support", "group_id": "g7"},
            }
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            await recv(ws, "session.updated")
            content = [{"type": "input_text", "text": "hi"}]
            item = {"type": "message", "role": "user", "content": content}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            done = (await recv(ws, "response.done"))[-1]
            (limits,) = await recv(ws, "rate_limits.updated")
            # Text answers are not counted by admission: every spoken slot is free.
            assert limits["rate_limits"] == [
                {"name": "requests", "limit": 3, "remaining": 3, "reset_seconds": 0.0}
            ]
    finally:
        await server.shutdown()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gateway.trace"]
    assert "workflow=support group=g7" in line and done["response"]["id"] in line


async def send_audio(ws: ClientConnection, pattern: list[bool]) -> None:
    """One 100 ms append per entry: a loud tone (True) or silence (False)."""
    for loud in pattern:
        event = {"type": "input_audio_buffer.append", "audio": speech_b64(100, loud)}
        await ws.send(json.dumps(event))


async def test_voice_turn_and_barge_in_with_server_vad() -> None:
    backend = FakeBackend(words=[f"w{i}" for i in range(20)], delay=0.02)
    server = await start_server(backend)
    try:
        async with connect(url(server)) as ws:
            await ws.recv()
            await send_audio(ws, [False] * 3 + [True] * 5 + [False] * 8)
            events = await recv(ws, "response.output_audio.delta")
            kinds = [e["type"] for e in events]
            assert (
                kinds.index("input_audio_buffer.speech_started")
                < kinds.index("input_audio_buffer.speech_stopped")
                < kinds.index("response.created")
            )
            session = backend.sessions[0]
            (first_id,) = session.turns
            turn = session.turns[first_id]
            assert turn.entry is Stage.ASR and turn.final is Stage.TTS
            # The pause before the stop prepared this very turn, and its start took it over.
            assert session.adopted == [first_id]
            # Talk over the assistant: barge-in.
            await send_audio(ws, [True] * 3)
            events = await recv(ws, "response.done")
            done = events[-1]["response"]
            assert done["id"] == first_id and done["status"] == "cancelled"
            assert done["status_details"]["reason"] == "turn_detected"
            assert (first_id, "turn_detected") in session.cancelled
            await session.ended(first_id)
            # Nothing of the cancelled response follows its response.done.
            await send_audio(ws, [False] * 8)
            events = await recv(ws, "response.done")
            assert events[-1]["response"]["id"] != first_id
            assert all(e.get("response_id") != first_id for e in events)
        status, body = await asyncio.to_thread(http_get, server, "/metrics")
        assert b"duplex_gateway_barge_ins_total 1.0" in body
        assert b'duplex_gateway_responses_total{status="cancelled"} 1.0' in body
        assert b"duplex_gateway_first_audio_seconds_count 2.0" in body
    finally:
        await server.shutdown()


async def test_transcription_job_when_server_vad_does_not_respond() -> None:
    backend = FakeBackend()
    server = await start_server(backend)
    try:
        async with connect(url(server)) as ws:
            await ws.recv()
            audio_input = {
                "transcription": {"model": "whisper-1", "language": "en"},
                "turn_detection": {"type": "server_vad", "create_response": False},
            }
            session_update = {"type": "realtime", "audio": {"input": audio_input}}
            await ws.send(json.dumps({"type": "session.update", "session": session_update}))
            await recv(ws, "session.updated")
            await send_audio(ws, [True] * 5 + [False] * 8)
            events = await recv(ws, "conversation.item.input_audio_transcription.completed")
            assert events[-1]["transcript"] == "fake transcript"
            assert not any(e["type"] == "response.created" for e in events)
            (turn,) = backend.sessions[0].turns.values()
            assert turn.final is Stage.ASR and turn.audio is not None
    finally:
        await server.shutdown()


async def test_oversized_event_is_an_error_and_oversized_frame_closes() -> None:
    server = await start_server(limits={"max_event_bytes": 4096, "max_frame_bytes": 65536})
    try:
        async with connect(url(server), max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 8000}))
            event = json.loads(await ws.recv())
            assert event["error"]["code"] == "event_too_large"
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            assert json.loads(await ws.recv())["type"] == "input_audio_buffer.cleared"
            await ws.send("x" * 70000)
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1009
    finally:
        await server.shutdown()


async def test_client_that_stops_reading_is_closed_by_the_send_queue_bound() -> None:
    # 100 s of audio per word: far more than socket buffers hold for a silent reader.
    backend = FakeBackend(words=["a", "b", "c", "d"], chunk_ms=100_000, delay=0)
    server = await start_server(backend, limits={"send_queue_events": 64})
    try:
        async with connect(url(server), max_queue=1) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "type": "realtime",
                            "audio": {"input": {"turn_detection": None}},
                        },
                    }
                )
            )
            await ws.send(
                json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "talk"}],
                        },
                    }
                )
            )
            await ws.send(json.dumps({"type": "response.create"}))
            # Read nothing until the server gives up on this client.
            async with asyncio.timeout(10):
                await backend.session_closed.wait()
            async with asyncio.timeout(10):
                with pytest.raises(ConnectionClosed):
                    while True:
                        await ws.recv()
            assert ws.close_code == 1008
        assert backend.sessions[0].cancelled  # its engine work was stopped
        status, body = await asyncio.to_thread(http_get, server, "/metrics")
        assert b"duplex_gateway_send_queue_overflows_total 1.0" in body
    finally:
        await server.shutdown()


async def test_shutdown_closes_sessions_with_1001() -> None:
    backend = FakeBackend()
    server = await start_server(backend)
    async with connect(url(server)) as ws:
        await ws.recv()
        await server.shutdown("bye")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert ws.close_code == 1001 and ws.close_reason == "bye"
    assert backend.closed
