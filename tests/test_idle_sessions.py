"""Idle sessions give their place to new connections when the gateway is full
(`idle_session_s`), so silent sockets never lock a user out; busy ones keep theirs."""

from __future__ import annotations

import json
import time

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.server.connection import IDLE_REASON
from gateway.server.server import GatewayServer
from tests.helpers import wait_until
from tests.test_gateway_server import recv, start_server, url

IDLE_S = 0.3


def idle_sessions(server: GatewayServer) -> int:
    now = time.monotonic()
    return sum(c.idle_for(now) >= IDLE_S for c in server.connections)


async def ask(ws: ClientConnection, text: str) -> list[dict]:
    content = [{"type": "input_text", "text": text}]
    item = {"type": "message", "role": "user", "content": content}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create"}))
    return await recv(ws, "response.done")


async def test_idle_sessions_do_not_take_a_speaking_users_place() -> None:
    server = await start_server(max_sessions=2, idle_session_s=IDLE_S)
    try:
        async with connect(url(server)) as idle, connect(url(server)) as user:
            await recv(idle, "session.created")
            await recv(user, "session.created")
            await wait_until(lambda: idle_sessions(server) == 2, 5, "both sessions idle")
            await ask(user, "hi")  # the user is busy again; the idle one is not
            async with connect(url(server)) as newcomer:
                await recv(newcomer, "session.created")
                with pytest.raises(ConnectionClosed):
                    await idle.recv()
                assert (idle.close_code, idle.close_reason) == (1001, IDLE_REASON)
                events = await ask(newcomer, "hello")
                assert events[-1]["response"]["status"] == "completed"
                events = await ask(user, "still here")
                assert events[-1]["response"]["status"] == "completed"
                assert len(server.connections) == 2
        assert server.metrics.idle_closed._value.get() == 1
    finally:
        await server.shutdown()


async def test_a_full_gateway_of_busy_sessions_still_refuses() -> None:
    server = await start_server(max_sessions=1, idle_session_s=60)
    try:
        async with connect(url(server)) as ws:
            await recv(ws, "session.created")
            with pytest.raises(InvalidStatus) as info:
                async with connect(url(server)):
                    pass
            assert info.value.response.status_code == 503
    finally:
        await server.shutdown()
