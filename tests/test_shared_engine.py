"""One client cannot stall the engine it shares with everyone, nor make it prefill more
than the profile allows (the gateway started through the CLI on the real models):
a long prompt in one session costs that session time, not another's, and messages or
instructions over their token limits are refused with an error naming the limit."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect

from tests.helpers import GatewayProcess, running_gateway, wait_until

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


def prefilled_tokens(gw: GatewayProcess) -> float:
    """The gateway's count of prompt tokens its LLM has prefilled so far."""
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "duplex_gateway_llm_tokens_total" and sample.labels["phase"] == "prefill"
    )


async def test_a_long_prompt_advances_only_a_slice_per_step_of_another_sessions_turn(
    gateway: GatewayProcess,
) -> None:
    """Without fair prefill, the short turn's first token waited for the long prompt's
    whole prefill (16.7 s instead of 0.35 s): here the long prompt may only advance one
    64-token slice per engine step while the short turn runs, a step count, not a time."""
    long_session = await open_text_session(gateway)
    short_session = await open_text_session(gateway)
    async with long_session, short_session:
        idle = prefilled_tokens(gateway)
        await ask(long_session, LONG_TEXT, max_output_tokens=8)
        await wait_until(lambda: prefilled_tokens(gateway) > idle, 60, "the long prefill")
        before = prefilled_tokens(gateway)
        await ask(short_session, "What is two plus two?", max_output_tokens=8)
        short = (await next_of(short_session, "response.done"))["response"]
        during = prefilled_tokens(gateway) - before
        assert short["status"] in ("completed", "incomplete")
        usage = short["usage"]
        own = usage["input_tokens"] - usage["input_token_details"]["cached_tokens"]
        # One slice per step: the short turn's prefill, each of its decode steps, and a
        # step on either side of it for the requests crossing the wire.
        steps = usage["output_tokens"] + 3
        assert during - own <= steps * 64, (during, own, steps)
        long = (await next_of(long_session, "response.done"))["response"]
        assert long["usage"]["input_tokens"] > 3000


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
