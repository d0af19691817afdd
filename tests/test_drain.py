"""Graceful drain of `GatewayServer` over a scripted backend whose responses end only when
the test releases them: health checks fail, new sessions are refused, idle sessions close
at once, a busy one after its response, and one still busy at the timeout is closed.
Then the CLI with the real models: a second SIGTERM cuts the drain short.

tests/test_deploy_nginx.py drains a real gateway behind nginx with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from duplex.turn import TurnRequest
from gateway.config import GatewayConfig
from gateway.server.server import DRAIN_REASON, DRAIN_TIMEOUT_REASON, GatewayServer
from gateway.session.backend import ResponseDone, ResponseOutput
from tests.fake_backend import IdleBackend, Reply, ScriptedSession
from tests.helpers import running_gateway, wait_until


def held(release: asyncio.Event) -> Reply:
    """Each response says "Hello" at once and is done only after `release`."""

    async def reply(session: ScriptedSession, response_id: str, turn: TurnRequest) -> None:
        session.put(ResponseOutput(response_id, "text", text="Hello"))
        await release.wait()
        session.put(ResponseDone(response_id, "completed"))

    return reply


class HeldBackend(IdleBackend):
    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    def open_session(self, session_id: str) -> ScriptedSession:
        return ScriptedSession(held(self.release))


async def started(**config: Any) -> tuple[GatewayServer, HeldBackend]:
    backend = HeldBackend()
    server = GatewayServer(GatewayConfig(port=0, **config), backend)
    await server.start()
    return server, backend


def url(server: GatewayServer) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/realtime?model=gpt-realtime"


def healthz(server: GatewayServer) -> tuple[int, dict[str, Any]]:
    return cli_health(server.port)


async def recv_until(ws: ClientConnection, kind: str, timeout: float = 10) -> list[dict[str, Any]]:
    events = []
    async with asyncio.timeout(timeout):
        while True:
            events.append(json.loads(await ws.recv()))
            if events[-1]["type"] == kind:
                return events


async def start_text_response(ws: ClientConnection) -> None:
    await recv_until(ws, "session.created")
    session = {"type": "realtime", "output_modalities": ["text"]}
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    await recv_until(ws, "session.updated")
    content = [{"type": "input_text", "text": "Hello."}]
    item = {"type": "message", "role": "user", "content": content}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create"}))
    await recv_until(ws, "response.output_text.delta")


async def closed_with(ws: ClientConnection) -> tuple[int, str, list[str]]:
    """Read to the close: its code and reason, and the event types that came before."""
    kinds = []
    with pytest.raises(ConnectionClosed) as closed:
        async with asyncio.timeout(10):
            while True:
                kinds.append(json.loads(await ws.recv())["type"])
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, closed.value.rcvd.reason, kinds


async def test_a_busy_session_finishes_its_response_then_closes() -> None:
    server, backend = await started(instance="gw-a")
    try:
        async with connect(url(server)) as busy, connect(url(server)) as idle:
            await start_text_response(busy)
            await recv_until(idle, "session.created")
            drain = asyncio.create_task(server.drain(timeout_s=60))
            assert await closed_with(idle) == (1001, DRAIN_REASON, [])
            status, health = await asyncio.to_thread(healthz, server)
            assert status == 503 and health["status"] == "draining"
            assert health["instance"] == "gw-a" and health["sessions"] == 1
            with pytest.raises(InvalidStatus) as refused:
                async with connect(url(server)):
                    pass
            assert refused.value.response.status_code == 503
            assert b"server_draining" in refused.value.response.body
            backend.release.set()
            code, reason, kinds = await closed_with(busy)
            assert (code, reason) == (1001, DRAIN_REASON)
            assert kinds[-2:] == ["response.done", "rate_limits.updated"]
            await drain
            assert not server.connections
    finally:
        await server.shutdown()


async def test_a_response_still_running_at_the_timeout_is_closed_with_its_reason() -> None:
    server, _ = await started()
    try:
        async with connect(url(server)) as busy:
            await start_text_response(busy)
            drain = asyncio.create_task(server.drain(timeout_s=0.2))
            code, reason, _ = await closed_with(busy)
            assert (code, reason) == (1001, DRAIN_TIMEOUT_REASON)
            await drain
    finally:
        await server.shutdown()


# -- the CLI: SIGTERM drains, a second one cuts the drain short ------------------------


@pytest.mark.models
async def test_a_second_sigterm_closes_a_busy_session_at_once() -> None:
    with running_gateway() as gw:
        async with connect(f"ws://127.0.0.1:{gw.port}/v1/realtime?model=gpt-realtime") as ws:
            await recv_until(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
            await recv_until(ws, "session.updated")
            story = "Tell me a long story about a lighthouse keeper."
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": story}],
            }
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            await recv_until(ws, "response.output_audio.delta", timeout=300)
            gw.proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: cli_health(gw.port)[0] == 503, 60, "the drain")
            gw.proc.send_signal(signal.SIGTERM)
            code, reason, _ = await closed_with(ws)
        assert (code, reason) == (1001, "server shutting down")
        assert gw.proc.wait(120) == 0
    assert not any("Traceback" in line for line in gw.lines), "".join(gw.lines[-30:])


def cli_health(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
