"""The sans-I/O realtime session driven event by event, with the engine played by the test."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from duplex.turn import Message, Stage
from gateway.config import GatewayConfig
from gateway.protocol.audio import PCM16, PCMA, PCMU, StreamResampler
from gateway.protocol.usage import realtime_usage
from gateway.session.actions import (
    Action,
    CancelResponse,
    ConfigureVad,
    Hear,
    PrepareResponse,
    StartResponse,
)
from gateway.session.backend import ResponseDone, ResponseOutput
from gateway.session.realtime import RealtimeSession

VOICE_RATE = 22050


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


def voice(ms: int, rate: int = VOICE_RATE, amp: float = 0.03) -> np.ndarray:
    """Engine audio: float32 samples at the voice's rate."""
    return np.full(int(rate * ms / 1000), amp, dtype=np.float32)


def text(rt: RealtimeSession, response_id: str, delta: str) -> None:
    rt.receive_response_event(ResponseOutput(response_id, "text", text=delta))


def transcript(rt: RealtimeSession, response_id: str, words: str) -> None:
    rt.receive_response_event(ResponseOutput(response_id, "transcript", text=words))


def audio(rt: RealtimeSession, response_id: str, ms: int, words: str = "") -> None:
    samples = voice(ms).astype("<f4").tobytes()
    out = ResponseOutput(response_id, "audio", text=words, audio=samples, sample_rate=VOICE_RATE)
    rt.receive_response_event(out)


def done(rt: RealtimeSession, response_id: str, status: Any = "completed", **fields: Any) -> None:
    rt.receive_response_event(ResponseDone(response_id, status, **fields))


def starts(actions: list[Action]) -> list[StartResponse]:
    return [a for a in actions if isinstance(a, StartResponse)]


def samples_of(turn_audio: bytes | None) -> np.ndarray:
    assert turn_audio is not None
    return np.frombuffer(turn_audio, dtype="<f4")


def manual(session: RealtimeSession, modalities: list[str] | None = None) -> None:
    update = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    if modalities:
        update["output_modalities"] = modalities
    session.events_to_send()
    assert types(send(session, type="session.update", session=update)) == ["session.updated"]
    session.actions()


def say(session: RealtimeSession, words: str = "Hi") -> None:
    """A user text item, so that a response has something to answer."""
    content = [{"type": "input_text", "text": words}]
    send(session, type="conversation.item.create", item={**_USER_TEXT, "content": content})


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
        (
            {"type": "realtime", "tools": [{"type": "mcp", "server_label": "f"}]},
            "session.tools.0.type",
        ),
        ({"type": "realtime", "tool_choice": "required"}, "session.tool_choice"),
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
            {"type": "realtime", "audio": {"input": {"noise_reduction": {"type": "studio"}}}},
            "session.audio.input.noise_reduction.type",
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


def _detection(**fields: object) -> dict:
    return {"type": "realtime", "audio": {"input": {"turn_detection": fields}}}


@pytest.mark.parametrize(
    ("beta", "session_update", "param", "rule"),
    [
        (False, {"type": "realtime", "max_output_tokens": True}, "max_output_tokens", "[1, 4096]"),
        (True, {"max_response_output_tokens": False}, "max_response_output_tokens", "[1, 4096]"),
        (False, _detection(threshold=True), "threshold", "finite number in (0.0, 1.0]"),
        (False, _detection(silence_duration_ms=True), "silence_duration_ms", "integer in [0,"),
        (False, _detection(prefix_padding_ms=False), "prefix_padding_ms", "integer in [0,"),
        (False, _detection(idle_timeout_ms=True), "idle_timeout_ms", "integer in [1000,"),
        (False, _detection(create_response=1), "create_response", "boolean"),
        (
            False,
            {"type": "realtime", "audio": {"output": {"speed": True}}},
            "speed",
            "finite number in [0.25, 1.5]",
        ),
        (
            False,
            {"type": "realtime", "audio": {"output": {"speed": float("nan")}}},
            "speed",
            "finite number in [0.25, 1.5]",
        ),
        (True, {"speed": float("inf")}, "speed", "finite number in [0.25, 1.5]"),
        (True, {"speed": -float("inf")}, "speed", "finite number in [0.25, 1.5]"),
        (True, {"temperature": float("nan")}, "temperature", "finite number"),
        (True, {"speed": 10**4000}, "speed", "finite number in [0.25, 1.5]"),
        (True, {"speed": -(10**4000)}, "speed", "finite number in [0.25, 1.5]"),
        (
            False,
            {
                "type": "realtime",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": True}}},
            },
            "rate",
            "integer",
        ),
    ],
)
def test_booleans_and_non_finite_numbers_are_refused_with_the_rule(
    beta: bool, session_update: dict, param: str, rule: str
) -> None:
    session = make(beta=beta)
    session.events_to_send()
    (event,) = send(session, type="session.update", session=session_update, event_id="evt_1")
    assert event["type"] == "error" and event["error"]["code"] == "invalid_value"
    assert event["error"]["param"].endswith(param) and event["error"]["event_id"] == "evt_1"
    assert rule in event["error"]["message"]
    going_on = {"instructions": "go on"} if beta else {"type": "realtime", "instructions": "x"}
    (updated,) = send(session, type="session.update", session=going_on)
    assert updated["type"] == "session.updated"  # the refused update changed nothing
    tokens = "max_response_output_tokens" if beta else "max_output_tokens"
    assert updated["session"][tokens] == "inf"


def test_booleans_are_not_integers_in_a_response_or_a_truncate() -> None:
    session = make()
    manual(session, ["text"])
    (event,) = send(session, type="response.create", response={"max_output_tokens": True})
    assert event["error"]["param"] == "response.max_output_tokens"
    assert "an integer in [1, 4096] or 'inf'" in event["error"]["message"]
    (event,) = send(
        session, type="conversation.item.truncate", item_id="x", content_index=0, audio_end_ms=True
    )
    assert event["error"]["param"] == "audio_end_ms"
    assert "an integer of at least 0" in event["error"]["message"]
    assert not starts(session.actions())


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
    ],
)
def test_response_metadata_is_bounded_as_documented(metadata: dict[str, str]) -> None:
    session = make()
    manual(session, ["text"])
    say(session)
    (event,) = send(session, type="response.create", response={"metadata": metadata})
    assert event["type"] == "error" and event["error"]["param"] == "response.metadata"
    message = event["error"]["message"]
    assert "at most 16 keys" in message and "64 characters" in message and "512" in message
    largest = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    (created,) = [
        e
        for e in send(session, type="response.create", response={"metadata": largest})
        if e["type"] == "response.created"
    ]
    assert created["response"]["metadata"] == largest


_USER_TEXT = {"type": "message", "role": "user", "content": [{"type": "input_text"}]}


@pytest.mark.parametrize(
    ("event", "param"),
    [
        (
            {"type": "session.update", "session": {"type": "realtime", "instructions": "a\ud800"}},
            "session",
        ),
        (
            {
                "type": "conversation.item.create",
                "item": {**_USER_TEXT, "content": [{"type": "input_text", "text": "\udfff"}]},
            },
            "item",
        ),
        ({"type": "response.create", "response": {"metadata": {"k": "\udc00"}}}, "response"),
        ({"type": "input_audio_buffer.clear", "event_id": "evt_\ud800"}, "event_id"),
    ],
)
def test_text_with_a_lone_surrogate_is_refused(event: dict, param: str) -> None:
    session = make()
    manual(session, ["text"])
    (error,) = send(session, **event)
    assert error["type"] == "error" and error["error"]["param"] == param
    assert "lone surrogate" in error["error"]["message"]
    assert not starts(session.actions())
    assert types(send(session, type="input_audio_buffer.clear")) == ["input_audio_buffer.cleared"]


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_json"),
        ('{"type": "input_audio_buffer.clear", "x": ' + "1" * 4301 + "}", "invalid_json"),
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


def test_text_turn_event_order_and_turn() -> None:
    session = make()
    manual(session, ["text"])
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    send(session, type="conversation.item.create", item=item)
    events = send(session, type="response.create")
    assert types(events) == ["response.created"]
    (start,) = session.actions()
    assert isinstance(start, StartResponse) and start.conversation
    turn = start.turn
    assert turn.text == "Hi" and turn.audio is None and turn.messages == ()
    assert (turn.entry, turn.final) == (Stage.LLM, Stage.LLM)
    assert turn.cache_key == session.settings.id
    assert turn.voice is None and turn.speed is None  # a text reply has no voice
    text(session, start.response_id, "Hello")
    text(session, start.response_id, " there")
    done(session, start.response_id, usage={"prompt_tokens": 5, "completion_tokens": 2})
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
    usage = events[-1]["response"]["usage"]
    assert usage == realtime_usage({"prompt_tokens": 5, "completion_tokens": 2})
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (5, 2, 7)
    # The next turn carries the history, the instructions leading it.
    send(session, type="conversation.item.create", item=item)
    send(session, type="response.create", response={"instructions": "Be brief."})
    (start,) = session.actions()
    assert start.turn.messages == (
        Message("system", "Be brief."),
        Message("user", "Hi"),
        Message("assistant", "Hello there"),
    )


def test_usage_without_engine_counts_reports_the_deltas() -> None:
    session = make()
    manual(session, ["text"])
    say(session)
    send(session, type="response.create")
    (start,) = session.actions()
    text(session, start.response_id, "a")
    text(session, start.response_id, "b")
    done(session, start.response_id)
    usage = session.events_to_send()[-1]["response"]["usage"]
    assert usage == realtime_usage({"completion_tokens": 2})


def test_second_response_while_active_is_an_error() -> None:
    session = make()
    manual(session)
    say(session)
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
    assert not start.conversation and start.turn.cache_key is None
    assert start.turn.text == "Summarise"
    text(session, start.response_id, "ok")
    done(session, start.response_id)
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
    # The commit starts transcribing the item: a turn of the session that ends at ASR.
    (job,) = starts(session.actions())
    assert isinstance(job, StartResponse) and not job.conversation
    assert job.turn.final == Stage.ASR and job.turn.entry == Stage.ASR
    assert job.turn.messages == () and job.turn.cache_key is None
    # A response to the item takes the transcription over, with the same audio.
    send(session, type="response.create")
    cancel, start = session.actions()
    assert cancel == CancelResponse(job.response_id, "superseded")
    assert isinstance(start, StartResponse) and start.conversation
    assert (start.turn.entry, start.turn.final) == (Stage.ASR, Stage.TTS)
    assert start.turn.audio == job.turn.audio
    assert start.turn.voice == "joe" and start.turn.speed == 1.0
    assert abs(len(samples_of(start.turn.audio)) - 2400) < 50  # 150 ms at 16 kHz
    # The superseded job is known until its done event; nothing of it reaches the client.
    done(session, job.response_id, "cancelled", reason="superseded")
    assert session.events_to_send() == []


def test_voice_turn_with_server_vad_transcription_and_audio_order() -> None:
    session = make()
    update = {"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}
    send(session, type="session.update", session=update)
    session.actions()
    for _ in range(10):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    feeds = [a for a in session.actions() if isinstance(a, Hear)]
    assert sum(len(f.samples) for f in feeds) > 15000
    assert all(f.samples.dtype == np.float32 for f in feeds)
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
    (start,) = starts(session.actions())
    assert abs(len(samples_of(start.turn.audio)) - 0.7 * 16000) < 100
    transcript(session, start.response_id, "hello there")
    audio(session, start.response_id, 250, "Hi!")
    audio(session, start.response_id, 100, "Bye.")
    done(session, start.response_id)
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
    assert max(sizes) <= 4800 and sum(sizes) == pytest.approx(0.35 * 48000, abs=4)
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
    items = session.conversation.items()
    assert items[0].message() == Message("user", "hello there")
    assert items[1].message() == Message("assistant", "Hi! Bye.")


def test_output_audio_is_resampled_once_per_response_and_encoded_once() -> None:
    session = make()
    manual(session)
    say(session)
    send(session, type="response.create")
    (start,) = session.actions()
    chunks = [voice(ms, amp=0.01 * ms / 50) for ms in (30, 170, 45, 200)]
    for chunk in chunks:
        out = ResponseOutput(
            start.response_id, "audio", audio=chunk.tobytes(), sample_rate=VOICE_RATE
        )
        session.receive_response_event(out)
    done(session, start.response_id)
    sent = b"".join(
        base64.b64decode(e["delta"])
        for e in session.events_to_send()
        if e["type"] == "response.output_audio.delta"
    )
    # One resampler over the whole response, its tail flushed at the end: the client
    # gets exactly the resampling of the concatenated audio, encoded once.
    resampler = StreamResampler(VOICE_RATE, PCM16.rate)
    pieces = [resampler.push(c) for c in chunks] + [resampler.push(voice(0), last=True)]
    assert sent == PCM16.encode(np.concatenate(pieces))


def test_a_voice_changing_rate_mid_response_is_a_bug_below() -> None:
    session = make()
    manual(session)
    say(session)
    send(session, type="response.create")
    (start,) = session.actions()
    audio(session, start.response_id, 100)
    out = ResponseOutput(start.response_id, "audio", audio=voice(10).tobytes(), sample_rate=16000)
    with pytest.raises(RuntimeError, match="16000 Hz"):
        session.receive_response_event(out)


def test_barge_in_cancels_and_finishes_on_the_cancelled_done() -> None:
    session = make()
    for _ in range(10):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    session.speech_started(100)
    session.speech_stopped(800)
    session.events_to_send()
    (start,) = starts(session.actions())
    transcript(session, start.response_id, "tell me a story")
    audio(session, start.response_id, 1000, "one two three four")
    audio(session, start.response_id, 1000, "five six seven eight")
    session.events_to_send()
    assert session.active_id == start.response_id
    session.speech_started(1000)
    # The cancel goes down and frees the conversation at once ...
    assert types(session.events_to_send()) == ["input_audio_buffer.speech_started"]
    assert CancelResponse(start.response_id, "turn_detected") in session.actions()
    assert session.active_id is None
    # ... but the response finishes only when the layer below reports its end.
    done(session, start.response_id, "cancelled", reason="turn_detected")
    events = session.events_to_send()
    assert types(events) == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "conversation.item.done",
        "response.output_item.done",
        "response.done",
    ]
    assert events[3]["item"]["status"] == "incomplete"
    finished = events[-1]["response"]
    assert finished["status"] == "cancelled"
    assert finished["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    # Its id is now unknown: a later event for it is a bug below.
    with pytest.raises(RuntimeError, match=start.response_id):
        audio(session, start.response_id, 100, "stale")
    item_id = events[3]["item"]["id"]
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
    (start,) = starts(session.actions())
    assert start.turn.messages == (
        Message("user", "tell me a story"),
        Message("assistant", "one two three four five six"),
    )
    retrieved = send(session, type="conversation.item.retrieve", item_id=item_id)[0]
    kept = base64.b64decode(retrieved["item"]["content"][0]["audio"])
    assert len(kept) == 1500 * 48


def test_a_new_response_can_start_before_the_cancelled_one_is_done() -> None:
    session = make()
    manual(session, ["text"])
    say(session)
    send(session, type="response.create")
    (first,) = session.actions()
    text(session, first.response_id, "partial")
    session.events_to_send()
    send(session, type="response.cancel")
    send(session, type="response.create")
    cancel, second = session.actions()
    # In this order below: the cancel reaches the engine before the next start.
    assert cancel == CancelResponse(first.response_id, "client_cancelled")
    assert isinstance(second, StartResponse) and session.active_id == second.response_id
    # The layer below drops the cancelled turn's later output; what it had already sent
    # is still the response's, and it finishes when its done event comes.
    text(session, first.response_id, " more")
    text(session, second.response_id, "fresh")
    done(session, first.response_id, "cancelled", reason="client_cancelled")
    events = session.events_to_send()
    finished = [e for e in events if e["type"] == "response.done"]
    assert [e["response"]["id"] for e in finished] == [first.response_id]
    assert finished[0]["response"]["status_details"]["reason"] == "client_cancelled"
    assert session.active_id == second.response_id


def test_cancel_of_a_cancelled_or_done_response_is_not_active() -> None:
    session = make()
    manual(session, ["text"])
    say(session)
    send(session, type="response.create")
    (start,) = session.actions()
    send(session, type="response.cancel")
    (event,) = send(session, type="response.cancel", response_id=start.response_id)
    assert event["error"]["code"] == "response_cancel_not_active"
    assert session.actions() == [CancelResponse(start.response_id, "client_cancelled")]
    done(session, start.response_id, "cancelled", reason="client_cancelled")
    session.events_to_send()
    (event,) = send(session, type="response.cancel", response_id=start.response_id)
    assert event["error"]["code"] == "response_cancel_not_active"


def test_a_response_that_ended_before_its_cancel_arrived_reports_how_it_ended() -> None:
    session = make()
    manual(session, ["text"])
    say(session)
    send(session, type="response.create")
    (start,) = session.actions()
    text(session, start.response_id, "all of it")
    send(session, type="response.cancel")
    done(session, start.response_id, "completed")
    assert session.events_to_send()[-1]["response"]["status"] == "completed"


def test_max_tokens_and_failure_statuses() -> None:
    session = make()
    manual(session, ["text"])
    say(session)
    send(session, type="response.create", response={"max_output_tokens": 5})
    (start,) = session.actions()
    assert start.turn.max_output_tokens == 5
    text(session, start.response_id, "a")
    done(session, start.response_id, "incomplete", reason="max_output_tokens")
    finished = session.events_to_send()[-1]["response"]
    assert finished["status"] == "incomplete"
    assert finished["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    send(session, type="response.create")
    (start,) = session.actions()
    done(session, start.response_id, "failed", error="the LLM fell over")
    error, response_done = session.events_to_send()
    assert error["type"] == "error" and error["error"]["code"] == "engine_error"
    assert error["error"]["message"] == "the LLM fell over"
    assert response_done["response"]["status"] == "failed"
    assert session.active_id is None
    send(session, type="response.create")
    (start,) = session.actions()
    message = "a user message has 5000 tokens; max_user_message_tokens is 4096"
    done(session, start.response_id, "failed", error=message, error_code="user_message_too_long")
    error, response_done = session.events_to_send()
    assert error["error"] == {
        "type": "invalid_request_error",
        "code": "user_message_too_long",
        "message": message,
        "param": None,
        "event_id": None,
    }
    assert response_done["response"]["status_details"]["error"]["code"] == "user_message_too_long"


def test_an_event_for_an_unknown_response_is_a_bug_below() -> None:
    session = make()
    manual(session, ["text"])
    with pytest.raises(RuntimeError, match="resp_nobody"):
        text(session, "resp_nobody", "hello")
    with pytest.raises(RuntimeError, match="resp_nobody"):
        done(session, "resp_nobody")


def test_close_cancels_every_running_turn_and_ignores_what_follows() -> None:
    session = make()
    manual(session, ["text"])
    send(session, type="input_audio_buffer.append", audio=tone_b64(200))
    send(session, type="input_audio_buffer.commit")
    (job,) = starts(session.actions())
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
    send(session, type="response.create", response={"conversation": "none", "input": [item]})
    (oob,) = session.actions()
    send(session, type="conversation.item.create", item=item)
    send(session, type="response.create")
    (first,) = session.actions()
    send(session, type="response.cancel")
    send(session, type="response.create")
    _, second = session.actions()
    session.events_to_send()
    session.close()
    # Each turn still running is cancelled; the one cancelled already is not again.
    assert session.actions() == [
        CancelResponse(oob.response_id, "client_cancelled"),
        CancelResponse(second.response_id, "client_cancelled"),
        CancelResponse(job.response_id, "client_cancelled"),
    ]
    assert session.active_id is None
    text(session, first.response_id, "late")
    done(session, first.response_id, "cancelled", reason="client_cancelled")
    done(session, "resp_nobody")
    assert session.events_to_send() == []


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
    job, start = starts(session.actions())
    assert job.turn.audio == start.turn.audio
    # The item's 8 kHz audio reaches the turn at 16 kHz, each sample once.
    assert len(samples_of(start.turn.audio)) == 3200
    audio(session, start.response_id, 300, "hi")
    done(session, start.response_id)
    deltas = [e for e in session.events_to_send() if e["type"] == "response.output_audio.delta"]
    sent = b"".join(base64.b64decode(d["delta"]) for d in deltas)
    assert len(sent) == pytest.approx(2400, abs=2)
    assert np.allclose(PCMA.decode(sent[100:-100]), 0.03, atol=0.003)


def test_server_vad_buffer_is_trimmed_and_manual_buffer_is_bounded() -> None:
    session = make()
    for _ in range(50):
        send(session, type="input_audio_buffer.append", audio=tone_b64(1000))
    assert session.audio_ms == 50_000
    session.speech_started(0)  # speech is found only in what is kept: the last append + 30 s
    session.speech_stopped(session.audio_ms)
    committed = session.events_to_send()[2]
    assert committed["type"] == "input_audio_buffer.committed"
    (start,) = starts(session.actions())
    assert len(samples_of(start.turn.audio)) == 31_000 * 16
    session = make(max_input_buffer_ms=1000)
    manual(session)
    for _ in range(10):
        assert send(session, type="input_audio_buffer.append", audio=tone_b64(100)) == []
    (event,) = send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    assert event["error"]["code"] == "input_audio_buffer_full"


def test_server_vad_keeps_all_of_one_long_append_for_the_vad_behind_it() -> None:
    # A client replays 40 s of recording in one append; the VAD hears it afterwards and
    # finds speech 5 s to 8 s in: that audio is still kept, and becomes the user's turn.
    session = make()
    session.events_to_send()
    assert send(session, type="input_audio_buffer.append", audio=tone_b64(40_000)) == []
    session.speech_started(5_000)
    session.speech_stopped(8_000)
    assert types(session.events_to_send())[:3] == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
    ]
    (start,) = starts(session.actions())
    assert len(samples_of(start.turn.audio)) == 3_000 * 16
    # Later appends let go of it only once 30 s more have come.
    for _ in range(31):
        send(session, type="input_audio_buffer.append", audio=tone_b64(1000))
    session.speech_started(10_000)  # heard far too late: the client sent faster than VAD
    session.speech_stopped(12_000)
    error = session.events_to_send()[-1]
    assert error["type"] == "error"
    assert error["error"]["code"] == "input_audio_buffer_commit_empty"
    assert "30000 ms" in error["error"]["message"]


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


# ---- prepared turns: the pause's turn equals the stop's -----------------------------


def _speaking(**config: Any) -> RealtimeSession:
    session = RealtimeSession(config=GatewayConfig(**config), model="m", beta=False)
    for _ in range(10):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    session.speech_started(200)
    session.events_to_send()
    session.actions()
    return session


def test_the_stop_starts_exactly_the_turn_its_pause_prepared() -> None:
    session = _speaking()
    session.speech_paused(900)
    (prepare,) = [a for a in session.actions() if isinstance(a, PrepareResponse)]
    session.speech_stopped(900)
    (start,) = starts(session.actions())
    assert start.turn == prepare.turn  # equal values: the start adopts the prepared work
    assert abs(len(samples_of(start.turn.audio)) - 0.7 * 16000) < 100


def test_a_pause_reaching_past_the_resampled_audio_flushes_it_for_both() -> None:
    session = _speaking()
    # Ending at the newest audio: the resampler still holds its last few ms back.
    session.speech_paused(session.audio_ms)
    (prepare,) = [a for a in session.actions() if isinstance(a, PrepareResponse)]
    assert len(samples_of(prepare.turn.audio)) == 800 * 16
    session.speech_stopped(session.audio_ms)
    (start,) = starts(session.actions())
    assert start.turn == prepare.turn


def test_speech_going_on_discards_the_prepared_turn() -> None:
    session = _speaking()
    session.speech_paused(600)
    session.speech_resumed()
    kinds = [type(a).__name__ for a in session.actions() if not isinstance(a, Hear)]
    assert kinds == ["PrepareResponse", "DiscardPrepared"]


def test_speech_over_the_committed_audio_limit_is_refused_and_its_turn_discarded() -> None:
    session = _speaking(limits={"max_committed_audio_s": 0.5})
    session.speech_paused(900)
    session.speech_stopped(900)
    stopped, error = session.events_to_send()
    assert stopped["type"] == "input_audio_buffer.speech_stopped"
    assert error["error"]["code"] == "input_audio_buffer_commit_too_large"
    assert "max_committed_audio_s" in error["error"]["message"]
    kinds = [type(a).__name__ for a in session.actions() if not isinstance(a, Hear)]
    assert kinds == ["PrepareResponse", "DiscardPrepared", "EndUtterance"]
    assert session.conversation.items() == []
