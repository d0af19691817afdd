"""Function calling in the sans-I/O realtime session, the engine played by the test:
tools and tool_choice in both protocol shapes, function_call output items and their
events, function_call_output items, and the turns that carry it all down."""

from __future__ import annotations

import json
from typing import Any

import pytest

from duplex.turn import Message, Stage, Tool, ToolCall, ToolChoice, TurnRequest
from gateway.config import GatewayConfig
from gateway.session.actions import CancelResponse, StartResponse
from gateway.session.backend import ResponseDone, ResponseOutput
from gateway.session.realtime import RealtimeSession

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {"type": "function", "name": "get_time", "description": "The local time"}


def make(beta: bool = False) -> RealtimeSession:
    session = RealtimeSession(config=GatewayConfig(), model="m", beta=beta)
    session.events_to_send()
    return session


def send(rt: RealtimeSession, /, **event: Any) -> list[dict[str, Any]]:
    rt.receive_text(json.dumps(event))
    return rt.events_to_send()


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def configure(rt: RealtimeSession, **fields: Any) -> dict[str, Any]:
    """A text session without VAD; returns the session object of `session.updated`."""
    if rt.beta:
        update = {"modalities": ["text"], "turn_detection": None, **fields}
    else:
        update = {
            "type": "realtime",
            "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
            **fields,
        }
    (event,) = send(rt, type="session.update", session=update)
    assert event["type"] == "session.updated", event
    rt.actions()
    return dict(event["session"])


def ask(rt: RealtimeSession, words: str = "What is the weather in Paris?") -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}
    send(rt, type="conversation.item.create", item=item)


def start(rt: RealtimeSession, **response: Any) -> StartResponse:
    events = send(rt, type="response.create", response=response)
    assert types(events) == ["response.created"], events
    (action,) = [a for a in rt.actions() if isinstance(a, StartResponse)]
    return action


def call(rt: RealtimeSession, response_id: str, arguments: str, index: int = 0) -> None:
    out = ResponseOutput(
        response_id, "tool_call", text=arguments, call_index=index, name="get_weather"
    )
    rt.receive_response_event(out)


def finish(
    rt: RealtimeSession, response_id: str, status: Any = "completed"
) -> list[dict[str, Any]]:
    rt.receive_response_event(ResponseDone(response_id, status))
    return rt.events_to_send()


# ---- the typed turn ------------------------------------------------------------------


def test_turn_tools_are_validated_values() -> None:
    tool = Tool("get_weather", "weather", json.dumps(WEATHER["parameters"]))
    turn = TurnRequest(
        final=Stage.LLM, text="hi", tools=(tool,), tool_choice=ToolChoice("required")
    )
    assert turn == TurnRequest(
        final=Stage.LLM, text="hi", tools=[tool], tool_choice=ToolChoice("required")
    )
    assert hash(turn) == hash(
        TurnRequest(final=Stage.LLM, text="hi", tools=(tool,), tool_choice=ToolChoice("required"))
    )
    with pytest.raises(ValueError, match="needs tools"):
        TurnRequest(final=Stage.LLM, text="hi", tool_choice=ToolChoice("required"))
    with pytest.raises(ValueError, match="not among the tools"):
        TurnRequest(final=Stage.LLM, tools=(tool,), tool_choice=ToolChoice("function", "other"))
    with pytest.raises(ValueError, match="unique"):
        TurnRequest(final=Stage.LLM, tools=(tool, tool))
    with pytest.raises(ValueError, match="JSON Schema object"):
        Tool("f", parameters="[1]")
    with pytest.raises(ValueError, match="tool name"):
        Tool("bad name")
    with pytest.raises(ValueError, match="only assistant"):
        Message("user", "x", tool_calls=(ToolCall("c", "f", "{}"),))
    with pytest.raises(ValueError, match="tool_call_id"):
        Message("tool", "result")


# ---- settings ------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [False, True])
def test_session_tools_and_choice_are_kept_and_echoed(beta: bool) -> None:
    rt = make(beta)
    choice = {"type": "function", "name": "get_time"}
    session = configure(rt, tools=[WEATHER, TIME], tool_choice=choice)
    assert [t["name"] for t in session["tools"]] == ["get_weather", "get_time"]
    assert session["tools"][0]["parameters"] == WEATHER["parameters"]
    assert session["tools"][1]["parameters"] == {"type": "object", "properties": {}}
    assert session["tool_choice"] == choice
    # A later update that sends neither keeps both; [] clears the tools.
    session = configure(rt, instructions="Be brief.")
    assert len(session["tools"]) == 2 and session["tool_choice"] == choice
    session = configure(rt, tools=[], tool_choice="auto")
    assert session["tools"] == [] and session["tool_choice"] == "auto"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "session.tools.0.type"),
        ({"tools": [{**WEATHER, "name": "no spaces"}]}, "session.tools.0.name"),
        ({"tools": [{**WEATHER, "parameters": [1]}]}, "session.tools.0.parameters"),
        ({"tools": [{**WEATHER, "strict": True}]}, "session.tools.0.strict"),
        ({"tools": [WEATHER, WEATHER]}, "session.tools"),
        ({"tool_choice": "always"}, "session.tool_choice"),
        ({"tool_choice": "required"}, "session.tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            "session.tool_choice",
        ),
    ],
)
def test_bad_tool_settings_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    rt = make()
    (event,) = send(rt, type="session.update", session={"type": "realtime", **fields})
    assert event["type"] == "error" and event["error"]["param"] == param, event
    assert rt.settings.tools == ()  # nothing changed
    configure(rt)  # and the session goes on


def test_response_overrides_carry_tools_and_choice_to_the_turn() -> None:
    rt = make()
    configure(rt, tools=[WEATHER])
    ask(rt)
    action = start(rt)
    assert [t.name for t in action.turn.tools] == ["get_weather"]
    assert action.turn.tool_choice == ToolChoice("auto")
    assert json.loads(action.turn.tools[0].parameters) == WEATHER["parameters"]
    finish(rt, action.response_id)
    ask(rt)
    action = start(rt, tools=[TIME], tool_choice={"type": "function", "name": "get_time"})
    assert [t.name for t in action.turn.tools] == ["get_time"]
    assert action.turn.tool_choice == ToolChoice("function", "get_time")
    finish(rt, action.response_id)
    ask(rt)
    (event,) = send(rt, type="response.create", response={"tool_choice": "sometimes"})
    assert event["type"] == "error" and event["error"]["param"] == "response.tool_choice"


# ---- calls ---------------------------------------------------------------------------


def test_a_call_streams_as_a_function_call_item() -> None:
    rt = make()
    configure(rt, tools=[WEATHER], tool_choice="required")
    ask(rt)
    action = start(rt)
    rid = action.response_id
    call(rt, rid, "")
    call(rt, rid, '{"city": ')
    call(rt, rid, '"Paris"}')
    events = rt.events_to_send()
    assert types(events) == [
        "response.output_item.added",
        "conversation.item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
    ]
    item = events[0]["item"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert item["call_id"].startswith("call_") and item["status"] == "in_progress"
    delta = events[2]
    assert delta["call_id"] == item["call_id"] and delta["item_id"] == item["id"]
    assert delta["output_index"] == 0 and delta["response_id"] == rid
    events = finish(rt, rid)
    assert types(events) == [
        "response.function_call_arguments.done",
        "conversation.item.done",
        "response.output_item.done",
        "response.done",
    ]
    assert events[0]["arguments"] == '{"city": "Paris"}' and events[0]["name"] == "get_weather"
    (output,) = events[-1]["response"]["output"]
    assert output == {**events[2]["item"], "status": "completed"}
    assert output["arguments"] == '{"city": "Paris"}'
    # No content part, nothing spoken: the call is the whole response.
    assert not any(e["type"].startswith("response.content_part") for e in events)


def test_text_then_a_call_are_two_outputs_in_order() -> None:
    rt = make()
    configure(rt, tools=[WEATHER])
    ask(rt)
    rid = start(rt).response_id
    rt.receive_response_event(ResponseOutput(rid, "text", text="Let me check."))
    call(rt, rid, '{"city": "Paris"}')
    events = rt.events_to_send() + finish(rt, rid)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "message"),
        (1, "function_call"),
    ]
    (args_done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert args_done["output_index"] == 1
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["message", "function_call"]


def _call_and_answer(rt: RealtimeSession) -> str:
    """Ask, get a call, finish; returns its call_id."""
    ask(rt)
    rid = start(rt).response_id
    call(rt, rid, '{"city": "Paris"}')
    events = rt.events_to_send() + finish(rt, rid)
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    return str(done["call_id"])


def test_the_result_reaches_the_next_turn() -> None:
    rt = make()
    configure(rt, tools=[WEATHER])
    call_id = _call_and_answer(rt)
    output = {"type": "function_call_output", "call_id": call_id, "output": '{"temp_c": 18}'}
    events = send(rt, type="conversation.item.create", item=output)
    assert types(events) == ["conversation.item.added", "conversation.item.done"]
    assert events[0]["item"]["type"] == "function_call_output"
    assert events[0]["item"]["call_id"] == call_id
    action = start(rt)
    turn = action.turn
    assert turn.text is None and turn.audio is None  # it answers the history
    *_, user, assistant, result = turn.messages
    assert user == Message("user", "What is the weather in Paris?")
    assert assistant == Message(
        "assistant", "", tool_calls=(ToolCall(call_id, "get_weather", '{"city": "Paris"}'),)
    )
    assert result == Message("tool", '{"temp_c": 18}', tool_call_id=call_id)


def test_a_result_for_an_unknown_call_is_refused() -> None:
    rt = make()
    configure(rt, tools=[WEATHER])
    output = {"type": "function_call_output", "call_id": "call_nope", "output": "{}"}
    (event,) = send(rt, type="conversation.item.create", item=output, event_id="e1")
    assert event["type"] == "error" and event["error"]["param"] == "item.call_id"
    assert "call_nope" in event["error"]["message"] and event["error"]["event_id"] == "e1"
    assert rt.conversation.items() == []


def test_client_made_calls_are_items_too() -> None:
    rt = make()
    configure(rt, tools=[WEATHER])
    made = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    events = send(rt, type="conversation.item.create", item=made)
    assert events[0]["item"] == {
        **made,
        "id": events[0]["item"]["id"],
        "object": "realtime.item",
        "status": "completed",
    }
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    assert (
        types(send(rt, type="conversation.item.create", item=result))[0]
        == "conversation.item.added"
    )
    (event,) = send(
        rt, type="conversation.item.create", item={"type": "function_call", "call_id": "c"}
    )
    assert event["type"] == "error" and event["error"]["param"] == "item.name"


def test_a_response_with_nothing_to_answer_follows_the_instructions_alone() -> None:
    rt = make()
    configure(rt, instructions="Greet the user.")
    first = start(rt)  # the assistant speaks first, as the service lets it
    assert first.turn.text is None and first.turn.audio is None
    assert [(m.role, m.content) for m in first.turn.messages] == [("system", "Greet the user.")]
    rt.receive_response_event(ResponseDone(first.response_id, "completed"))
    assert types(rt.events_to_send())[-1] == "response.done"
    out_of_band = start(rt, conversation="none", input=[]).turn
    assert out_of_band.text is None and len(out_of_band.messages) == 1


def test_cancel_during_a_call_leaves_it_incomplete_and_out_of_the_context() -> None:
    rt = make()
    configure(rt, tools=[WEATHER], tool_choice="required")
    ask(rt)
    rid = start(rt).response_id
    call(rt, rid, '{"city": "Pa')
    rt.events_to_send()
    send(rt, type="response.cancel")
    assert any(isinstance(a, CancelResponse) for a in rt.actions())
    events = finish(rt, rid, "cancelled")
    assert types(events) == [
        "response.function_call_arguments.done",
        "conversation.item.done",
        "response.output_item.done",
        "response.done",
    ]
    response = events[-1]["response"]
    assert response["status"] == "cancelled"
    assert response["output"][0]["status"] == "incomplete"
    # The cut-off call is not shown to the model again.
    ask(rt, "Never mind.")
    turn = start(rt, tool_choice="none").turn
    assert not any(m.tool_calls for m in turn.messages)
    assert turn.tool_choice == ToolChoice("none")


def test_beta_call_events_and_items() -> None:
    rt = make(beta=True)
    configure(rt, tools=[WEATHER])
    ask(rt)
    rid = start(rt).response_id
    call(rt, rid, '{"city": "Paris"}')
    events = rt.events_to_send() + finish(rt, rid)
    assert types(events) == [
        "response.output_item.added",
        "conversation.item.created",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.done",
    ]
    assert events[-1]["response"]["output"][0]["type"] == "function_call"


def test_barge_in_during_a_call_cancels_it_as_any_response() -> None:
    rt = make()
    (event,) = send(rt, type="session.update", session={"type": "realtime", "tools": [WEATHER]})
    assert event["type"] == "session.updated"
    rt.actions()
    ask(rt)
    rid = start(rt, output_modalities=["text"]).response_id
    call(rt, rid, '{"city": ')
    rt.events_to_send()
    rt.speech_started(0.0)
    (cancel,) = [a for a in rt.actions() if isinstance(a, CancelResponse)]
    assert (cancel.response_id, cancel.reason) == (rid, "turn_detected")
    done = finish(rt, rid, "cancelled")[-1]["response"]
    assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert done["output"][0]["type"] == "function_call"
    assert done["output"][0]["status"] == "incomplete"


def test_the_engine_backend_forwards_call_outputs() -> None:
    from duplex.events import TurnOutput
    from duplex.outputs import DuplexStageOutput
    from gateway.session.engine_backend import _response_output

    out = DuplexStageOutput(
        session_id="s",
        request_id="r",
        stage_id=1,
        kind="tool_call",
        text='{"city"',
        metadata={"index": 2, "name": "get_weather"},
    )
    assert out.shows_client
    mapped = _response_output("resp_1", TurnOutput(turn_id=0, output=out, tag="resp_1"))
    assert mapped == ResponseOutput(
        "resp_1", "tool_call", text='{"city"', call_index=2, name="get_weather"
    )
