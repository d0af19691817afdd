"""The sans-I/O realtime session driven event by event, with the engine played by the test."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from gateway.audio import PCM16, PCMU
from gateway.config import GatewayConfig
from gateway.realtime import (
    CancelResponse,
    ConfigureVad,
    FeedVad,
    RealtimeSession,
    StartResponse,
    TranscribeItem,
)


def make(beta: bool = False, **limits: object) -> RealtimeSession:
    config = GatewayConfig(limits=limits) if limits else GatewayConfig()
    session = RealtimeSession(config=config, model="m", beta=beta)
    return session


def send(rt: RealtimeSession, /, **event: object) -> list[dict]:
    rt.receive_text(json.dumps(event))
    return rt.events_to_send()


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def tone_b64(ms: int, fmt=PCM16, amp: float = 0.3) -> str:
    t = np.arange(int(fmt.rate * ms / 1000)) / fmt.rate
    return base64.b64encode(fmt.encode(amp * np.sin(2 * np.pi * 220 * t))).decode()


def pcm(ms: int, rate: int = 22050) -> bytes:
    return (np.ones(int(rate * ms / 1000)) * 1000).astype("<i2").tobytes()


def manual(session: RealtimeSession, modalities: list[str] | None = None) -> None:
    update = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    if modalities:
        update["output_modalities"] = modalities
    session.events_to_send()
    assert types(send(session, type="session.update", session=update)) == ["session.updated"]
    session.actions()


def test_session_created_first_with_full_ga_object() -> None:
    session = make()
    (event,) = session.events_to_send()
    assert event["type"] == "session.created"
    assert event["event_id"].startswith("event_") and len(event["event_id"]) == 27
    obj = event["session"]
    assert obj["id"].startswith("sess_") and obj["type"] == "realtime"
    assert obj["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert obj["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert isinstance(session.actions()[0], ConfigureVad)


def test_beta_session_object_and_renames() -> None:
    session = make(beta=True)
    obj = session.events_to_send()[0]["session"]
    assert obj["input_audio_format"] == "pcm16" and obj["modalities"] == ["audio"]
    events = send(session, type="session.update", session={"turn_detection": None})
    assert events[0]["session"]["turn_detection"] is None
    events = send(
        session,
        type="conversation.item.create",
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    )
    assert types(events) == ["conversation.item.created"]


def test_session_update_merges_partial_turn_detection() -> None:
    session = make()
    session.events_to_send()
    session.actions()
    update = {"type": "realtime", "audio": {"input": {"turn_detection": {"threshold": 0.8}}}}
    (event,) = send(session, type="session.update", session=update)
    detection = event["session"]["audio"]["input"]["turn_detection"]
    assert detection["type"] == "server_vad" and detection["threshold"] == 0.8
    (action,) = session.actions()
    assert isinstance(action, ConfigureVad) and action.settings.threshold == 0.8


@pytest.mark.parametrize(
    ("session_update", "param"),
    [
        (
            {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
            "session.audio.input.turn_detection.type",
        ),
        ({"type": "realtime", "tools": [{"type": "function", "name": "f"}]}, "session.tools"),
        ({"type": "realtime", "audio": {"output": {"voice": "nobody"}}}, "session.voice"),
        ({"type": "realtime", "output_modalities": ["text", "audio"]}, "output_modalities"),
        ({"type": "realtime", "model": "other"}, "session.model"),
        ({"type": "realtime", "bogus": 1}, "session.bogus"),
        ({"type": "transcription"}, "session.type"),
        (
            {
                "type": "realtime",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
            },
            "session.audio.input.format",
        ),
        (
            {"type": "realtime", "audio": {"input": {"noise_reduction": {"type": "near_field"}}}},
            "session.audio.input.noise_reduction",
        ),
        ({}, "session.type"),
    ],
)
def test_unsupported_settings_are_rejected(session_update: dict, param: str) -> None:
    session = make()
    session.events_to_send()
    (event,) = send(session, type="session.update", session=session_update, event_id="evt_1")
    assert event["type"] == "error"
    assert event["error"]["param"] == param
    assert event["error"]["event_id"] == "evt_1"


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_json"),
        ('{"type": "nope.nope"}', "invalid_value"),
        ('{"type": "input_audio_buffer.append"}', "missing_required_parameter"),
        ('{"type": "input_audio_buffer.append", "audio": 5}', "invalid_value"),
        ('{"type": "input_audio_buffer.append", "audio": "!!!"}', "invalid_value"),
        ('{"type": "input_audio_buffer.append", "audio": "AAAA"}', "invalid_value"),
        ('{"type": "response.cancel"}', "response_cancel_not_active"),
        ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty"),
        ('{"type": "conversation.item.delete", "item_id": "x"}', "item_not_found"),
        ('{"type": "output_audio_buffer.clear"}', "invalid_value"),
    ],
)
def test_bad_frames_get_error_events_and_session_survives(frame: str, code: str) -> None:
    session = make()
    manual(session)
    session.events_to_send()
    session.receive_text(frame)
    (event,) = session.events_to_send()
    assert event["type"] == "error" and event["error"]["code"] == code
    assert types(send(session, type="input_audio_buffer.clear")) == ["input_audio_buffer.cleared"]


def test_binary_frame_is_an_error() -> None:
    session = make()
    session.events_to_send()
    session.receive_binary(10)
    assert session.events_to_send()[0]["error"]["code"] == "invalid_event"


def test_text_turn_event_order_and_plan() -> None:
    session = make()
    manual(session, ["text"])
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    send(session, type="conversation.item.create", item=item)
    events = send(session, type="response.create")
    assert types(events) == ["response.created"]
    (start,) = session.actions()
    assert isinstance(start, StartResponse)
    assert start.prompt["text"] == "Hi" and start.prompt["messages"] == []
    assert (start.entry_stage_id, start.final_stage_id) == (1, 1)
    assert start.prompt["cache_key"] == session.settings.id
    session.response_text(start.response_id, "Hello")
    session.response_text(start.response_id, " there")
    session.response_done(start.response_id, {"total_tokens": 3}, "stop")
    events = session.events_to_send()
    assert types(events) == [
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "conversation.item.done",
        "response.output_item.done",
        "response.done",
    ]
    assert events[5]["text"] == "Hello there"
    assert events[-1]["response"]["status"] == "completed"
    assert events[-1]["response"]["usage"] == {"total_tokens": 3}
    # The next turn carries the history.
    send(session, type="conversation.item.create", item=item)
    send(session, type="response.create", response={"instructions": "Be brief."})
    (start,) = session.actions()
    assert start.prompt["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
    ]


def test_second_response_while_active_is_an_error() -> None:
    session = make()
    manual(session)
    send(session, type="response.create")
    (event,) = send(session, type="response.create", event_id="e2")
    assert event["error"]["code"] == "conversation_already_has_active_response"
    assert event["error"]["event_id"] == "e2"


def test_out_of_band_response_is_not_added_to_conversation() -> None:
    session = make()
    manual(session, ["text"])
    send(session, type="response.create")
    session.actions()
    send(
        session,
        type="response.create",
        response={
            "conversation": "none",
            "metadata": {"topic": "x"},
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Summarise"}],
                }
            ],
        },
    )
    (start,) = session.actions()
    assert start.out_of_band and start.prompt["cache_key"] is None
    assert start.prompt["text"] == "Summarise"
    session.response_text(start.response_id, "ok")
    session.response_done(start.response_id, None, "stop")
    events = session.events_to_send()
    assert "conversation.item.added" not in types(events)
    assert events[-1]["response"]["metadata"] == {"topic": "x"}
    assert events[-1]["response"]["conversation_id"] is None


def test_manual_audio_turn_and_commit_limits() -> None:
    session = make()
    manual(session)
    send(session, type="input_audio_buffer.append", audio=tone_b64(50))
    (event,) = send(session, type="input_audio_buffer.commit")
    assert event["error"]["code"] == "input_audio_buffer_commit_empty"
    send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    events = send(session, type="input_audio_buffer.commit")
    assert types(events) == [
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert events[1]["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    # The commit starts transcribing the item; a response to it takes that over.
    (job,) = session.actions()
    assert isinstance(job, TranscribeItem)
    send(session, type="response.create")
    cancel, start = session.actions()
    assert cancel == CancelResponse(job.job_id, "superseded")
    assert start.entry_stage_id == 0 and start.final_stage_id == 2
    assert start.prompt["audio"].dtype == np.float32
    assert abs(len(start.prompt["audio"]) - 2400) < 50  # 150 ms at 16 kHz


def test_voice_turn_with_server_vad_transcription_and_audio_order() -> None:
    session = make()
    update = {"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}
    send(session, type="session.update", session=update)
    session.actions()
    for _ in range(10):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    feeds = [a for a in session.actions() if isinstance(a, FeedVad)]
    assert sum(len(f.samples) for f in feeds) > 15000
    session.speech_started(200)
    session.speech_stopped(900)
    events = session.events_to_send()
    assert types(events) == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    user_id = events[0]["item_id"]
    assert {e.get("item_id") for e in events[1:3]} == {user_id}
    assert events[3]["item"]["id"] == user_id
    (start,) = [a for a in session.actions() if isinstance(a, StartResponse)]
    assert abs(len(start.prompt["audio"]) - 0.7 * 16000) < 100
    session.response_transcript(start.response_id, "hello there")
    session.response_audio(start.response_id, pcm(250), 22050, "Hi!")
    session.response_audio(start.response_id, pcm(100), 22050, "Bye.")
    session.response_done(start.response_id, None, "stop")
    events = session.events_to_send()
    kinds = types(events)
    assert kinds[:2] == [
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
    ]
    assert kinds[2:6] == [
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio_transcript.delta",
    ]
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    sizes = [len(base64.b64decode(d["delta"])) for d in deltas]
    assert max(sizes) <= 4800 and sum(sizes) > 0.34 * 48000
    assert kinds[-6:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "conversation.item.done",
        "response.output_item.done",
        "response.done",
    ]
    assert events[-5]["transcript"] == "Hi! Bye."
    # History: the user's transcript and the assistant's words.
    send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    assert session.conversation.items()[0].message() == {"role": "user", "content": "hello there"}


def test_barge_in_cancels_and_truncate_shapes_next_context() -> None:
    session = make()
    for _ in range(10):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    session.speech_started(100)
    session.speech_stopped(800)
    session.events_to_send()
    (start,) = [a for a in session.actions() if isinstance(a, StartResponse)]
    session.response_transcript(start.response_id, "tell me a story")
    session.response_audio(start.response_id, pcm(1000), 22050, "one two three four")
    session.response_audio(start.response_id, pcm(1000), 22050, "five six seven eight")
    session.events_to_send()
    session.speech_started(1000)
    events = session.events_to_send()
    assert types(events) == [
        "input_audio_buffer.speech_started",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "conversation.item.done",
        "response.output_item.done",
        "response.done",
    ]
    assert events[4]["item"]["status"] == "incomplete"
    done = events[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert CancelResponse(start.response_id, "turn_detected") in session.actions()
    # Late engine outputs of the cancelled response are dropped.
    session.response_audio(start.response_id, pcm(100), 22050, "stale")
    session.response_done(start.response_id, None, "stop")
    assert session.events_to_send() == []
    item_id = events[4]["item"]["id"]
    (event,) = send(
        session,
        type="conversation.item.truncate",
        item_id=item_id,
        content_index=0,
        audio_end_ms=1500,
    )
    assert event["type"] == "conversation.item.truncated"
    (event,) = send(
        session,
        type="conversation.item.truncate",
        item_id=item_id,
        content_index=0,
        audio_end_ms=99999,
    )
    assert event["error"]["param"] == "audio_end_ms"
    for _ in range(5):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    session.speech_stopped(1400)
    session.events_to_send()
    (start,) = [a for a in session.actions() if isinstance(a, StartResponse)]
    assert start.prompt["messages"] == [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": "one two three four five six"},
    ]
    retrieved = send(session, type="conversation.item.retrieve", item_id=item_id)[0]
    audio = base64.b64decode(retrieved["item"]["content"][0]["audio"])
    assert len(audio) == 1500 * 48


def test_cancel_race_after_done_is_not_active() -> None:
    session = make()
    manual(session, ["text"])
    send(session, type="response.create")
    (start,) = session.actions()
    session.response_done(start.response_id, None, "stop")
    session.events_to_send()
    (event,) = send(session, type="response.cancel", response_id=start.response_id)
    assert event["error"]["code"] == "response_cancel_not_active"


def test_client_cancel_and_max_tokens_status() -> None:
    session = make()
    manual(session, ["text"])
    send(session, type="response.create", response={"max_output_tokens": 5})
    (start,) = session.actions()
    assert start.prompt["max_output_tokens"] == 5
    events = send(session, type="response.cancel")
    assert events[-1]["response"]["status_details"]["reason"] == "client_cancelled"
    send(session, type="response.create")
    (_, start) = session.actions()
    session.response_text(start.response_id, "a")
    session.response_done(start.response_id, None, "length")
    done = session.events_to_send()[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"]["reason"] == "max_output_tokens"


def test_items_insert_retrieve_delete() -> None:
    session = make()
    manual(session)

    def item(text: str, **extra: object) -> dict:
        return {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
            **extra,
        }

    a = send(session, type="conversation.item.create", item=item("a", id="item_a"))
    assert a[0]["previous_item_id"] is None
    b = send(session, type="conversation.item.create", item=item("b"), previous_item_id="root")
    assert b[0]["previous_item_id"] is None
    assert [i.text() for i in session.conversation.items()] == ["b", "a"]
    c = send(session, type="conversation.item.create", item=item("c"), previous_item_id="nope")
    assert c[0]["error"]["param"] == "previous_item_id"
    dup = send(session, type="conversation.item.create", item=item("d", id="item_a"))
    assert dup[0]["type"] == "error"
    bad = send(
        session,
        type="conversation.item.create",
        item={
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_audio", "transcript": "x"}],
        },
    )
    assert bad[0]["error"]["param"] == "item.content.0.type"
    assert send(session, type="conversation.item.retrieve", item_id="item_a")[0]["item"]["id"]
    assert types(send(session, type="conversation.item.delete", item_id="item_a")) == [
        "conversation.item.deleted"
    ]


def test_g711_in_and_out_independent() -> None:
    session = make()
    update = {
        "type": "realtime",
        "output_modalities": ["audio"],
        "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
            "output": {"format": {"type": "audio/pcma"}},
        },
    }
    send(session, type="session.update", session=update)
    send(session, type="input_audio_buffer.append", audio=tone_b64(200, PCMU))
    assert session.audio_ms == pytest.approx(200)
    send(session, type="input_audio_buffer.commit")
    send(session, type="response.create")
    start = [a for a in session.actions() if isinstance(a, StartResponse)][0]
    session.response_audio(start.response_id, pcm(300), 22050, "hi")
    session.response_done(start.response_id, None, "stop")
    deltas = [e for e in session.events_to_send() if e["type"] == "response.output_audio.delta"]
    assert sum(len(base64.b64decode(d["delta"])) for d in deltas) == pytest.approx(2400, abs=80)


def test_server_vad_buffer_is_trimmed_and_manual_buffer_is_bounded() -> None:
    session = make()
    for _ in range(50):
        send(session, type="input_audio_buffer.append", audio=tone_b64(1000))
    assert len(session._buffer) <= 30_000 * 48
    session = make(max_input_buffer_ms=1000)
    manual(session)
    for _ in range(10):
        assert send(session, type="input_audio_buffer.append", audio=tone_b64(100)) == []
    (event,) = send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    assert event["error"]["code"] == "input_audio_buffer_full"


def test_idle_timeout_commits_and_responds() -> None:
    session = make()
    update = {"type": "realtime", "audio": {"input": {"turn_detection": {"idle_timeout_ms": 1000}}}}
    send(session, type="session.update", session=update)
    events: list[dict] = []
    for _ in range(11):
        events += send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    assert types(events)[0] == "input_audio_buffer.timeout_triggered"
    assert "response.created" in types(events)


def test_conversation_item_limit() -> None:
    session = make(max_items=2)
    manual(session)
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
    send(session, type="conversation.item.create", item=item)
    send(session, type="conversation.item.create", item=item)
    (event,) = send(session, type="conversation.item.create", item=item)
    assert event["type"] == "error" and "maximum" in event["error"]["message"]
