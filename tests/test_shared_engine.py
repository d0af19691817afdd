"""One client cannot stall the engine it shares with everyone, nor make it prefill more
than the profile allows (the gateway started through the CLI on the real models):
a long prompt in one session costs that session time, not another's, and messages or
instructions over their token limits are refused with an error naming the limit."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.helpers import GatewayProcess, running_gateway

pytestmark = pytest.mark.models

# About 3,300 tokens: under the default max_user_message_tokens (4,096), so it is
# prefilled, in 52 slices of 64 tokens.
LONG_TEXT = " ".join(f"Item {i} of the list is a word about weather and tea." for i in range(250))


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with running_gateway() as gw:
        yield gw


async def open_text_session(gw: GatewayProcess) -> ClientConnection:
    ws = await connect(f"ws://127.0.0.1:{gw.port}/v1/realtime", max_size=None)
    assert json.loads(await ws.recv())["type"] == "session.created"
    session = {"type": "realtime", "output_modalities": ["text"], "audio": {}}
    session["audio"] = {"input": {"turn_detection": None}}
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    await next_of(ws, "session.updated")
    return ws


async def next_of(ws: ClientConnection, *kinds: str, timeout: float = 120) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            event = json.loads(await ws.recv())
            if event["type"] in kinds:
                return event


async def ask(ws: ClientConnection, text: str, **response: Any) -> None:
    content = [{"type": "input_text", "text": text}]
    item = {"type": "message", "role": "user", "content": content}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create", "response": response}))


async def test_a_short_turn_finishes_while_another_session_prefills_a_long_prompt(
    gateway: GatewayProcess,
) -> None:
    long_session, short_session = await open_text_session(gateway), await open_text_session(gateway)
    async with long_session, short_session:
        await ask(long_session, LONG_TEXT, max_output_tokens=8)
        await next_of(long_session, "response.created")
        await ask(short_session, "What is two plus two?", max_output_tokens=8)
        short_done = await next_of(short_session, "response.done")
        short_finished_at = time.monotonic()
        assert short_done["response"]["status"] in ("completed", "incomplete")
        first_long = await next_of(long_session, "response.output_text.delta", "response.done")
        # The long prompt was still being prefilled: its first word came after.
        assert first_long["type"] == "response.output_text.delta"
        assert time.monotonic() >= short_finished_at
        long_done = await next_of(long_session, "response.done")
        usage = long_done["response"]["usage"]
        assert usage["input_tokens"] > 3000


async def refused(ws: ClientConnection) -> tuple[dict[str, Any], dict[str, Any]]:
    error = await next_of(ws, "error")
    done = await next_of(ws, "response.done")
    return error["error"], done["response"]


async def test_over_long_messages_and_instructions_are_refused_naming_the_limit(
    gateway: GatewayProcess,
) -> None:
    async with await open_text_session(gateway) as ws:
        await ask(ws, LONG_TEXT * 4)  # about 13,000 tokens
        error, response = await refused(ws)
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "user_message_too_long"
        assert "max_user_message_tokens" in error["message"]
        assert response["status"] == "failed"

        instructions = "Always answer politely. " * 45_000  # about 1 MiB
        await ws.send(
            json.dumps({"type": "response.create", "response": {"instructions": instructions}})
        )
        error, response = await refused(ws)
        assert error["code"] == "instructions_too_long"
        assert "max_instructions_tokens" in error["message"]

        # The session goes on.
        await ask(ws, "Say hello.", max_output_tokens=8)
        done = await next_of(ws, "response.done")
        assert done["response"]["status"] in ("completed", "incomplete")
