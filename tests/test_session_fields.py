"""Session and response fields of the SDK beyond the basics, driven through the sans-I/O
session: OpenAI voice names, temperature, parallel tool calls, retention-ratio
truncation, stored prompts, tracing, reasoning and noise reduction."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.config import OPENAI_VOICES, GatewayConfig
from gateway.session.actions import StartResponse
from gateway.session.backend import ResponseDone
from gateway.session.realtime import RealtimeSession

PROMPTS = {
    "pmpt_weather": {
        "1": "You report the weather.",
        "2": "You report the weather in {{city}}, in {{unit}}.",
    }
}


def make(*, beta: bool = False, **config: Any) -> RealtimeSession:
    session = RealtimeSession(config=GatewayConfig(**config), model="m", beta=beta)
    session.events_to_send()
    session.actions()
    return session


def send(session: RealtimeSession, /, **event: Any) -> list[dict[str, Any]]:
    session.receive_text(json.dumps(event))
    return session.events_to_send()


def update(session: RealtimeSession, **fields: Any) -> dict[str, Any]:
    body = fields if session.beta else {"type": "realtime", **fields}
    (event,) = send(session, type="session.update", session=body)
    return event


def respond(session: RealtimeSession, **response: Any) -> StartResponse:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    send(session, type="conversation.item.create", item=item)
    session.actions()
    events = send(session, type="response.create", response=response)
    assert events[0]["type"] == "response.created", events
    (start,) = [a for a in session.actions() if isinstance(a, StartResponse)]
    return start


@pytest.mark.parametrize("name", OPENAI_VOICES)
def test_every_openai_voice_is_spoken_by_the_profile_table(name: str) -> None:
    session = make(voices=("joe", "amy"), openai_voices={"ash": "amy"})
    event = update(session, audio={"output": {"voice": name}})
    assert event["type"] == "session.updated"
    assert event["session"]["audio"]["output"]["voice"] == name  # the name asked for
    start = respond(session)
    assert start.turn.voice == ("amy" if name == "ash" else "joe")


def test_beta_voice_and_response_voice_map_too() -> None:
    session = make(beta=True, openai_voices={"alloy": "joe"})
    assert update(session, voice="alloy")["session"]["voice"] == "alloy"
    start = respond(session, voice="verse")
    assert start.turn.voice == "joe"


def test_an_unknown_voice_is_refused_and_nothing_applied() -> None:
    session = make()
    event = update(session, instructions="Be brief.", audio={"output": {"voice": "nobody"}})
    assert event["type"] == "error" and event["error"]["param"] == "session.voice"
    assert "alloy" in event["error"]["message"] and "joe" in event["error"]["message"]
    assert session.settings.instructions == ""
    event = update(session, audio={"output": {"voice": {"id": "voice_1234"}}})
    assert event["type"] == "error" and event["error"]["param"] == "session.voice"
    assert "custom voice 'voice_1234' is not available" in event["error"]["message"]


def test_a_voice_table_naming_a_voice_the_profile_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of this profile's voices"):
        GatewayConfig(openai_voices={"alloy": "amy"})


def test_beta_temperature_reaches_the_turn() -> None:
    session = make(beta=True)
    assert update(session, temperature=0.8)["session"]["temperature"] == 0.8
    assert respond(session).turn.temperature == 0.8
    session = make(beta=True)
    assert respond(session, temperature=1.1).turn.temperature == 1.1
    assert session.settings.temperature is None  # a response's own setting


@pytest.mark.parametrize("value", [0.2, 1.5, True, "hot"])
def test_temperature_out_of_range_is_refused(value: object) -> None:
    session = make(beta=True)
    event = update(session, temperature=value, instructions="x")
    assert event["type"] == "error" and event["error"]["param"] == "session.temperature"
    assert session.settings.instructions == ""


def test_parallel_tool_calls_and_reasoning_are_kept_and_reported() -> None:
    session = make()
    event = update(session, parallel_tool_calls=False, reasoning={"effort": "low"})
    assert event["session"]["parallel_tool_calls"] is False
    assert event["session"]["reasoning"] == {"effort": "low"}
    assert respond(session).turn.parallel_tool_calls is False
    session = make()
    assert respond(session, parallel_tool_calls=True).turn.parallel_tool_calls is True


def test_retention_ratio_truncation_reaches_the_turn_and_cuts_history_in_blocks() -> None:
    session = make(limits={"max_context_messages": 10})
    truncation = {
        "type": "retention_ratio",
        "retention_ratio": 0.5,
        "token_limits": {"post_instructions": 500},
    }
    event = update(session, truncation=truncation, audio={"input": {"turn_detection": None}})
    assert event["session"]["truncation"] == truncation
    kept = []
    for _ in range(14):
        start = respond(session)
        kept.append(len(start.turn.messages))
        assert start.turn.retention_ratio == 0.5 and start.turn.post_instructions_tokens == 500
        session.receive_response_event(ResponseDone(start.response_id, "completed"))
    # History grows to the limit, then drops half of it at once, and grows from there.
    assert kept == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 6, 7, 8]


def test_stored_prompt_renders_into_the_system_message() -> None:
    session = make(prompts=PROMPTS)
    prompt = {"id": "pmpt_weather", "variables": {"city": "Paris", "unit": "celsius"}}
    event = update(session, prompt=prompt, instructions="Be brief.")
    assert event["session"]["prompt"] == {**prompt, "version": "2"}
    system = respond(session).turn.messages[0]
    assert system.content == "You report the weather in Paris, in celsius.\n\nBe brief."
    session = make(prompts=PROMPTS)
    system = respond(session, prompt={"id": "pmpt_weather", "version": "1"}).turn.messages[0]
    assert system.content == "You report the weather."


@pytest.mark.parametrize(
    ("prompt", "param", "words"),
    [
        ({"id": "pmpt_nope"}, "session.prompt.id", "unknown prompt"),
        ({"id": "pmpt_weather", "version": "7"}, "session.prompt.version", "no version"),
        (
            {"id": "pmpt_weather", "variables": {"city": "Paris"}},
            "session.prompt.variables",
            "unit",
        ),
        (
            {
                "id": "pmpt_weather",
                "variables": {
                    "city": {
                        "type": "input_image",
                        "image_url": "https://x/y.png",
                        "detail": "auto",
                    },
                    "unit": "celsius",
                },
            },
            "session.prompt.variables.city",
            "images",
        ),
    ],
)
def test_a_bad_stored_prompt_is_refused_with_its_reason(
    prompt: dict[str, Any], param: str, words: str
) -> None:
    session = make(prompts=PROMPTS)
    event = update(session, prompt=prompt)
    assert event["type"] == "error" and event["error"]["param"] == param
    assert words in event["error"]["message"]
    assert session.settings.prompt is None


def test_tracing_is_kept_once_set() -> None:
    session = make()
    assert update(session, tracing="auto")["session"]["tracing"] == "auto"
    assert update(session, tracing="auto")["type"] == "session.updated"
    event = update(session, tracing={"workflow_name": "other"})
    assert event["type"] == "error" and event["error"]["param"] == "session.tracing"
    session = make(beta=True)
    traced = update(session, tracing={"workflow_name": "support", "group_id": "g1"})
    assert traced["session"]["tracing"] == {"workflow_name": "support", "group_id": "g1"}


def test_noise_reduction_is_accepted_and_reported() -> None:
    session = make()
    event = update(session, audio={"input": {"noise_reduction": {"type": "far_field"}}})
    assert event["session"]["audio"]["input"]["noise_reduction"] == {"type": "far_field"}
    assert update(session, audio={"input": {"noise_reduction": None}})["type"] == "session.updated"
    assert session.settings.noise_reduction is None
    session = make(beta=True)
    event = update(session, input_audio_noise_reduction={"type": "near_field"})
    assert event["session"]["input_audio_noise_reduction"] == {"type": "near_field"}


def test_an_image_stays_refused_with_its_reason() -> None:
    session = make()
    content = [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]
    (event,) = send(
        session,
        type="conversation.item.create",
        item={"type": "message", "role": "user", "content": content},
    )
    assert event["type"] == "error" and "image" in event["error"]["message"]
