"""Function calling through the official `openai` SDK, unmodified, against `duplex-gateway`
started through its CLI with the real embedded models, GA and beta: the full tool loop,
`tool_choice` none / required / named, a cancel during a call, a spoken answer after a
call, and the OpenAI Agents SDK's realtime agent with one function tool."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml

from tests.helpers import ROOT, espeak, pcm16, running_gateway
from tests.realtime_client import client, until

pytestmark = pytest.mark.models

MODEL = "duplex-smollm2"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "The local time in a time zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string"}},
        "required": ["zone"],
    },
}
# A call long enough to be cancelled while its arguments stream.
NUMBERS = {
    "type": "function",
    "name": "add_numbers",
    "description": "Adds numbers",
    "parameters": {
        "type": "object",
        "properties": {"numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 40}},
        "required": ["numbers"],
    },
}
RESULT = json.dumps({"city": "Paris", "temperature_celsius": 18, "sky": "foggy"})


def uses_result(answer: str) -> bool:
    return "18" in answer or "fog" in answer.lower()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The default profile with greedy decoding, so answers do not depend on a draw."""
    profile = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    profile["stages"]["llm"]["sampling"]["temperature"] = 0.0
    path = tmp_path_factory.mktemp("profile") / "greedy.yaml"
    path.write_text(yaml.safe_dump(profile))
    with running_gateway("--config", str(path)) as gw:
        yield f"ws://127.0.0.1:{gw.port}/v1"


def user_text(words: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}


def calls_in(events: list[Any]) -> list[Any]:
    return [e for e in events if e.type == "response.function_call_arguments.done"]


def text_in(events: list[Any]) -> str:
    kinds = ("response.output_text.delta", "response.text.delta")
    return "".join(e.delta for e in events if e.type in kinds)


def spoken(words: str) -> str:
    """`words` spoken by eSpeak NG (a voice independent of the gateway's), as base64
    PCM16 at 24 kHz."""
    return base64.b64encode(pcm16(espeak(words, 24000))).decode()


async def tool_loop(
    conn: Any, session: dict[str, Any], question: dict[str, Any] | None = None
) -> tuple[list[Any], list[Any]]:
    """Ask for the weather, check the call, answer it; the call's and the answer's events."""
    await conn.session.update(session=session)
    await until(conn, "session.updated")
    await conn.conversation.item.create(item=question or user_text("What is the weather in Paris?"))
    await conn.response.create(response={"tool_choice": "required"})
    called = await until(conn, "response.done")
    (done,) = calls_in(called)
    assert done.name == "get_weather"
    arguments = json.loads(done.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    deltas = "".join(e.delta for e in called if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments
    (item,) = called[-1].response.output
    assert (item.type, item.call_id, item.status) == ("function_call", done.call_id, "completed")
    result = {"type": "function_call_output", "call_id": done.call_id, "output": RESULT}
    await conn.conversation.item.create(item=result)
    # The answer, not another call: the embedded 135M model, left to choose right after
    # a result, mostly echoes the result's markup instead of answering.
    await conn.response.create(response={"tool_choice": "none"})
    answered = await until(conn, "response.done")
    assert answered[-1].response.status == "completed"
    return called, answered


async def test_ga_tool_loop_in_text(gateway: str) -> None:
    session = {
        "type": "realtime",
        "output_modalities": ["text"],
        "audio": {"input": {"turn_detection": None}},
        "tools": [WEATHER],
        "tool_choice": "auto",
    }
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        called, answered = await tool_loop(conn, session)
        kinds = [e.type for e in called]
        assert "response.output_text.delta" not in kinds  # a call is not text
        assert kinds.index("conversation.item.added") < kinds.index(
            "response.function_call_arguments.delta"
        )
        assert not calls_in(answered)
        assert uses_result(text_in(answered)), text_in(answered)


async def test_beta_tool_loop_in_text(gateway: str) -> None:
    session = {"modalities": ["text"], "turn_detection": None, "tools": [WEATHER]}
    async with client(gateway).beta.realtime.connect(model=MODEL) as conn:
        called, answered = await tool_loop(conn, session)
        assert "conversation.item.created" in {e.type for e in called}
        assert uses_result(text_in(answered)), text_in(answered)


async def test_tool_loop_in_speech(gateway: str) -> None:
    """A spoken question, an unspoken call, a spoken answer."""
    session = {
        "type": "realtime",
        "output_modalities": ["audio"],
        "audio": {"input": {"turn_detection": None, "transcription": {"model": "whisper-1"}}},
        "tools": [WEATHER],
    }
    content = [{"type": "input_audio", "audio": spoken("What is the weather in Paris?")}]
    question = {"type": "message", "role": "user", "content": content}
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        called, answered = await tool_loop(conn, session, question)
        (heard,) = [
            e for e in called if e.type == "conversation.item.input_audio_transcription.completed"
        ]
        assert "paris" in heard.transcript.lower()
        (call,) = calls_in(called)
        assert "paris" in json.loads(call.arguments)["city"].lower()
        assert not any(e.type == "response.output_audio.delta" for e in called)
        assert any(e.type == "response.output_audio.delta" for e in answered)
        (transcript,) = [e for e in answered if e.type == "response.output_audio_transcript.done"]
        assert transcript.transcript


@pytest.mark.parametrize("beta", [False, True])
async def test_tool_choice_none_required_and_named(gateway: str, beta: bool) -> None:
    base = client(gateway)
    connection = base.beta.realtime.connect if beta else base.realtime.connect
    if beta:
        session: dict[str, Any] = {"modalities": ["text"], "turn_detection": None}
    else:
        session = {
            "type": "realtime",
            "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
        }
    async with connection(model=MODEL) as conn:
        await conn.session.update(session={**session, "tools": [WEATHER, TIME]})
        await until(conn, "session.updated")
        await conn.conversation.item.create(item=user_text("What is the weather in Paris?"))
        await conn.response.create(response={"tool_choice": "none"})
        events = await until(conn, "response.done")
        assert not calls_in(events) and text_in(events)
        await conn.response.create(response={"tool_choice": "required"})
        (call,) = calls_in(await until(conn, "response.done"))
        assert call.name in ("get_weather", "get_time")
        named = {"type": "function", "name": "get_time"}
        await conn.response.create(response={"tool_choice": named})
        (call,) = calls_in(await until(conn, "response.done"))
        assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), TIME["parameters"])
        # A result for a call that was never made is refused, and the session goes on.
        stray = {"type": "function_call_output", "call_id": "call_unknown", "output": "{}"}
        await conn.conversation.item.create(item=stray)
        (error,) = [e for e in await until(conn, "error") if e.type == "error"]
        assert error.error.param == "item.call_id"


async def test_cancel_during_a_call(gateway: str) -> None:
    session = {
        "type": "realtime",
        "output_modalities": ["text"],
        "audio": {"input": {"turn_detection": None}},
        "tools": [NUMBERS],
    }
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await conn.session.update(session=session)
        await until(conn, "session.updated")
        await conn.conversation.item.create(item=user_text("Add up forty numbers."))
        await conn.response.create(response={"tool_choice": "required"})
        await until(conn, "response.function_call_arguments.delta")
        await conn.response.cancel()
        events = await until(conn, "response.done")
        response = events[-1].response
        assert response.status == "cancelled"
        assert response.status_details.reason == "client_cancelled"
        (item,) = response.output
        assert item.type == "function_call" and item.status == "incomplete"
        # The session goes on: the next response answers without calling.
        await conn.response.create(response={"tool_choice": "none"})
        events = await until(conn, "response.done")
        assert events[-1].response.status == "completed" and not calls_in(events)


async def test_the_assistant_may_speak_first(gateway: str) -> None:
    """A response with nothing to answer follows the instructions alone, as the service
    does: the reply that opens a conversation."""
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        await conn.response.create()
        events = await until(conn, "response.done")
        assert not [e for e in events if e.type == "error"]
        done = events[-1].response
        assert done.status == "completed" and done.output[0].content[0].text.strip()


async def test_agents_sdk_realtime_agent_calls_a_function_tool(gateway: str) -> None:
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner

    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return f"It is 18 degrees and cloudy in {city}."

    agent = RealtimeAgent(
        name="Weather", instructions="Answer weather questions.", tools=[get_weather]
    )
    settings = {
        "model_name": MODEL,
        "modalities": ["text"],
        "turn_detection": None,
        "tool_choice": "required",
    }
    # The SDK's default voice ("ash") and tracing ("auto") as they are.
    runner = RealtimeRunner(agent, config={"model_settings": settings})
    url = f"{gateway}/realtime?model={MODEL}"
    session = await runner.run(model_config={"url": url, "api_key": "sk-local"})
    kinds: list[str] = []
    async with session:
        await session.send_message("What is the weather in Paris?")
        async with asyncio.timeout(120):
            async for event in session:
                kinds.append(event.type)
                assert event.type != "error", event
                if event.type == "raw_model_event" and _sent_result(event.data):
                    break
    assert asked and asked[0].strip() and kinds.index("tool_start") < kinds.index("tool_end")


def _sent_result(data: Any) -> bool:
    """The gateway took the agent's function_call_output into the conversation."""
    raw = getattr(data, "data", None)
    if not isinstance(raw, dict) or raw.get("type") != "conversation.item.added":
        return False
    return bool(raw["item"].get("type") == "function_call_output")
