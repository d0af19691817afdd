"""The WebSocket server and connection shell over a scripted engine (fast, no models).

The fake engine speaks fixed replies and detects speech by signal energy through the
real `SpeechDetector`, so every protocol path runs over a real socket in milliseconds.
"""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from engine.speech_detector import SpeechDetector, SpeechStarted
from gateway.backend import SpeechEvent, TurnOutput
from gateway.config import GatewayConfig
from gateway.realtime import StartResponse
from gateway.server import GatewayServer

RATE = 24000


class FakeSession:
    """Replies with `words`, one 200 ms audio chunk (or text delta) per word."""

    def __init__(self, words: list[str], chunk_ms: int, delay: float) -> None:
        self.words = words
        self.chunk_ms = chunk_ms
        self.delay = delay
        self.queue: asyncio.Queue[TurnOutput | None] = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.prompts: list[dict[str, Any]] = []
        self.cancelled: list[tuple[str, bool]] = []
        self.prepared: list[dict[str, Any]] = []

    def start(self, action: StartResponse) -> None:
        self.prompts.append(action.prompt)
        self.tasks[action.response_id] = asyncio.create_task(self._run(action))

    async def _run(self, action: StartResponse) -> None:
        rid = action.response_id
        if action.entry_stage_id == 0:
            self.queue.put_nowait(TurnOutput(rid, "transcript", text="fake transcript"))
        for word in self.words:
            await asyncio.sleep(self.delay)
            self.queue.put_nowait(TurnOutput(rid, "text", text=word + " "))
            if action.final_stage_id == 2:
                pcm = (np.ones(RATE * self.chunk_ms // 1000) * 3000).astype("<i2").tobytes()
                self.queue.put_nowait(
                    TurnOutput(rid, "audio", text=word, audio=pcm, sample_rate=RATE)
                )
        usage = {"total_tokens": 9, "input_tokens": 5, "output_tokens": 4}
        self.queue.put_nowait(TurnOutput(rid, "done", usage=usage))

    def transcribe(self, job_id: str, audio: np.ndarray) -> None:
        self.queue.put_nowait(TurnOutput(job_id, "transcript", text="fake transcript"))
        self.queue.put_nowait(TurnOutput(job_id, "done"))

    def prepare(self, action: Any) -> None:
        self.prepared.append(action.prompt)

    def discard_prepared(self) -> None:
        self.prepared.clear()

    def cancel(self, response_id: str, barge_in: bool) -> None:
        self.cancelled.append((response_id, barge_in))
        task = self.tasks.pop(response_id, None)
        if task is not None:
            task.cancel()

    async def outputs(self) -> AsyncIterator[TurnOutput]:
        while (out := await self.queue.get()) is not None:
            yield out

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.queue.put_nowait(None)


class EnergySpeech:
    """Server VAD stand-in: a 32 ms chunk is speech when its RMS exceeds 0.05."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[SpeechEvent | None] = asyncio.Queue()
        self.detector: SpeechDetector | None = None
        self.start_ms = 0.0
        self.pending = np.zeros(0, np.float32)

    def configure(self, settings: Any, start_ms: float, pause_after_ms: int | None = None) -> None:
        self.pending = np.zeros(0, np.float32)
        self.start_ms = start_ms
        self.detector = (
            None
            if settings is None
            else SpeechDetector(
                settings.threshold, settings.prefix_padding_ms, settings.silence_duration_ms
            )
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
                self.queue.put_nowait(SpeechEvent("started", self.start_ms + d.audio_start_ms))
            else:
                self.queue.put_nowait(SpeechEvent("stopped", self.start_ms + d.audio_end_ms))

    async def events(self) -> AsyncIterator[SpeechEvent]:
        while (event := await self.queue.get()) is not None:
            yield event

    async def close(self) -> None:
        self.queue.put_nowait(None)


class FakeBackend:
    def __init__(
        self, words: list[str] | None = None, chunk_ms: int = 200, delay: float = 0.005
    ) -> None:
        self.words = words or ["Hello", "there", "friend"]
        self.chunk_ms = chunk_ms
        self.delay = delay
        self.sessions: list[FakeSession] = []
        self.closed = False

    def open_session(self, session_id: str) -> FakeSession:
        session = FakeSession(self.words, self.chunk_ms, self.delay)
        self.sessions.append(session)
        return session

    def open_speech(self, session_id: str) -> EnergySpeech:
        return EnergySpeech()

    def pending(self) -> dict[str, int]:
        return {}

    def prepared_turns(self) -> dict[str, int]:
        return {}

    async def close(self) -> None:
        self.closed = True


async def start_server(backend: FakeBackend | None = None, **config: Any) -> GatewayServer:
    server = GatewayServer(GatewayConfig(port=0, **config), backend or FakeBackend())
    await server.start()
    return server


def url(server: GatewayServer, path: str = "/v1/realtime?model=duplex-smollm2") -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


async def recv(ws: Any, until: str, timeout: float = 5.0) -> list[dict]:
    events = []
    async with asyncio.timeout(timeout):
        while True:
            event = json.loads(await ws.recv())
            events.append(event)
            if event["type"] == until:
                return events


def speech_b64(ms: int, loud: bool) -> str:
    t = np.arange(RATE * ms // 1000) / RATE
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
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, body = await asyncio.to_thread(http_get, server, "/metrics")
        assert status == 200 and b"duplex_gateway_open_sessions" in body
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
        protocols = ["realtime", "openai-insecure-api-key.secret", "openai-beta.realtime-v1"]
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
            async with connect(url(server), origin="http://evil.example"):
                pass
        assert info.value.response.status_code == 403
        async with connect(url(server), origin="http://good.example") as ws:
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
            assert backend.sessions[0].prompts[0]["text"] == "hi"
    finally:
        await server.shutdown()


async def test_voice_turn_and_barge_in_with_server_vad() -> None:
    backend = FakeBackend(words=[f"w{i}" for i in range(20)], delay=0.02)
    server = await start_server(backend)
    try:
        async with connect(url(server)) as ws:
            await ws.recv()
            for loud in [False] * 3 + [True] * 5 + [False] * 8:
                await ws.send(
                    json.dumps(
                        {"type": "input_audio_buffer.append", "audio": speech_b64(100, loud)}
                    )
                )
            events = await recv(ws, "response.output_audio.delta")
            kinds = [e["type"] for e in events]
            assert (
                kinds.index("input_audio_buffer.speech_started")
                < kinds.index("input_audio_buffer.speech_stopped")
                < kinds.index("response.created")
            )
            # Talk over the assistant: barge-in.
            for loud in [True] * 3:
                await ws.send(
                    json.dumps(
                        {"type": "input_audio_buffer.append", "audio": speech_b64(100, loud)}
                    )
                )
            events = await recv(ws, "response.done")
            done = events[-1]["response"]
            assert done["status"] == "cancelled"
            assert done["status_details"]["reason"] == "turn_detected"
            cancelled_id = done["id"]
            assert (cancelled_id, True) in backend.sessions[0].cancelled
            await asyncio.sleep(0.1)
            # Nothing of the cancelled response follows its response.done.
            for loud in [False] * 8:
                await ws.send(
                    json.dumps(
                        {"type": "input_audio_buffer.append", "audio": speech_b64(100, loud)}
                    )
                )
            events = await recv(ws, "response.created")
            assert all(e.get("response_id") != cancelled_id for e in events)
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
            await asyncio.sleep(1.0)  # read nothing while the server produces
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
