"""The connection shell's order of work, over a real WebSocket and the real duplex
session manager (a scripted stage port, no models): a speech decision's actions are
carried out before the backend's next events are read, so a barge-in's cancel reaches
the duplex fence before outputs already queued for the cancelled response reach the
client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.client import connect

from duplex.events import SpeechDecision
from duplex.manager import DuplexSessionManager
from duplex.outputs import stage_id_from_request_id
from duplex.session import RESIDENT_ROLE
from gateway.config import GatewayConfig
from gateway.server.server import GatewayServer
from gateway.session.engine_backend import EngineBackendSession
from tests.fake_backend import IdleBackend
from tests.fakes import FakeStagePort


class DuplexBackend(IdleBackend):
    """Each connection as one session of a real duplex session manager over `port`."""

    def __init__(self, port: FakeStagePort) -> None:
        super().__init__()
        self.manager = DuplexSessionManager(port, max_sessions=4)

    def open_session(self, session_id: str) -> EngineBackendSession:
        return EngineBackendSession(self.manager.open(session_id))


async def test_a_barge_in_cancels_before_outputs_already_queued_reach_the_client() -> None:
    port = FakeStagePort()
    submitted = asyncio.Event()
    port.on_submit = lambda submission: (
        submitted.set() if not submission.resumable else None  # a turn, not an append
    )
    backend = DuplexBackend(port)
    server = GatewayServer(GatewayConfig(port=0), backend)
    await server.start()
    try:
        url = f"ws://127.0.0.1:{server.port}/v1/realtime?model=duplex-smollm2"
        async with connect(url) as ws:
            await ws.recv()  # session.created
            detection = {"type": "server_vad", "create_response": False}
            session = {"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Tell me a story."}],
            }
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            async with asyncio.timeout(10):
                await submitted.wait()
            [speaker] = [r for r in port.reserved if stage_id_from_request_id(r) == 2]
            [resident] = [r for r in port.reserved if r.endswith(f".r.{RESIDENT_ROLE}")]
            # The user starts speaking while the reply's audio is already on its way up:
            # both reach the connection in the same turn of the event loop, VAD first.
            started = SpeechDecision("started", 0.0)
            port.push(resident, "speech", **started.as_metadata())
            port.push(speaker, "audio", "Once", audio_ms=40)
            events = await until(ws, "response.done")
    finally:
        await server.shutdown()
    kinds = [e["type"] for e in events]
    started = kinds.index("input_audio_buffer.speech_started")
    between = [k for k in kinds[started:] if k.endswith(".delta")]
    assert between == [], kinds
    assert events[-1]["response"]["status"] == "cancelled", events[-1]
    assert events[-1]["response"]["status_details"]["reason"] == "turn_detected"


async def until(ws: Any, kind: str) -> list[dict[str, Any]]:
    """Events up to and including the first of type `kind`."""
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(10):
        while not events or events[-1]["type"] != kind:
            events.append(json.loads(await ws.recv()))
    return events
