"""Transcription sessions (GA `session.type: "transcription"`, beta `?intent=transcription`)
and the transcription settings of every session: `prompt`, `include`, the model names.
The sans-I/O session driven event by event, then the server over a scripted engine."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from duplex.turn import Stage
from gateway.config import GatewayConfig
from gateway.protocol.audio import PCM16
from gateway.protocol.session_config import LOGPROBS, LiveTranscription
from gateway.session.actions import ConfigureVad, DiscardPrepared, PrepareResponse, StartResponse
from gateway.session.backend import ResponseDone, ResponseOutput
from gateway.session.conversation import Item
from gateway.session.input_buffer import Clip
from gateway.session.realtime import RealtimeSession
from gateway.session.turns import transcription_turn
from tests.helpers import tone_b64
from tests.test_gateway_server import FakeBackend, recv, send_audio, start_server, url

WHISPER = {"model": "whisper-1", "language": None, "prompt": None}


def transcription(beta: bool = False, **config: Any) -> RealtimeSession:
    """A new transcription session, greeted, its greeting taken."""
    session = RealtimeSession(config=GatewayConfig(**config), model="m", beta=beta)
    session.open_as_transcription()
    return session


def send(session: RealtimeSession, /, **event: Any) -> list[dict[str, Any]]:
    session.receive_text(json.dumps(event))
    return session.events_to_send()


def update(session: RealtimeSession, **fields: Any) -> dict[str, Any]:
    """A GA transcription session's update; the one event it got back."""
    (event,) = send(session, type="session.update", session={"type": "transcription", **fields})
    return event


def beta_update(session: RealtimeSession, **fields: Any) -> dict[str, Any]:
    (event,) = send(session, type="transcription_session.update", session=fields)
    return event


def audio_input(**fields: Any) -> dict[str, Any]:
    return {"input": fields}


def speak(session: RealtimeSession, start_ms: float = 200, end_ms: float = 900) -> None:
    """One second of input audio in which server VAD heard speech from start to end."""
    for _ in range(10):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    session.actions()
    session.speech_started(start_ms)
    session.speech_stopped(end_ms)


# ---- greeting -------------------------------------------------------------------------


def test_a_ga_transcription_session_is_greeted_as_one() -> None:
    session = transcription()
    (event,) = session.events_to_send()
    assert event["type"] == "session.created"
    obj = event["session"]
    assert obj["type"] == "transcription" and obj["object"] == "realtime.transcription_session"
    assert obj["id"].startswith("sess_") and obj["include"] is None
    assert set(obj) == {"type", "object", "id", "expires_at", "include", "audio"}
    assert obj["audio"] == {
        "input": {
            "format": {"type": "audio/pcm", "rate": 24000},
            "transcription": WHISPER,
            "noise_reduction": None,
            "turn_detection": {
                "type": "server_vad",
                "threshold": 0.5,
                "prefix_padding_ms": 300,
                "silence_duration_ms": 500,
            },
        }
    }
    # The VAD runs with settings that never answer.
    vad = [a for a in session.actions() if isinstance(a, ConfigureVad)][-1]
    assert vad.settings is not None
    assert not vad.settings.create_response and not vad.settings.interrupt_response


def test_a_beta_transcription_session_is_greeted_in_the_beta_shape() -> None:
    session = transcription(beta=True)
    (event,) = session.events_to_send()
    assert event["type"] == "transcription_session.created"
    obj = event["session"]
    assert obj["object"] == "realtime.transcription_session"
    assert obj["input_audio_format"] == "pcm16" and obj["modalities"] == ["text"]
    assert obj["input_audio_transcription"] == WHISPER
    assert obj["input_audio_noise_reduction"] is None and obj["include"] is None
    assert obj["turn_detection"]["type"] == "server_vad"
    assert "create_response" not in obj["turn_detection"]
    assert not {"voice", "instructions", "tools"} & set(obj)


# ---- updates --------------------------------------------------------------------------


def test_a_ga_update_sets_every_input_setting() -> None:
    session = transcription(semantic_vad=True)
    session.events_to_send()
    words = {"model": "gpt-4o-transcribe", "language": "en", "prompt": "Dragons, castles."}
    event = update(
        session,
        audio=audio_input(
            format={"type": "audio/pcmu"},
            transcription=words,
            turn_detection={"type": "semantic_vad", "eagerness": "high"},
            noise_reduction=None,
        ),
        include=[LOGPROBS],
    )
    assert event["type"] == "session.updated"
    obj = event["session"]
    assert obj["type"] == "transcription" and obj["include"] == [LOGPROBS]
    assert obj["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert obj["audio"]["input"]["transcription"] == words  # the name given is echoed
    assert obj["audio"]["input"]["turn_detection"] == {"type": "semantic_vad", "eagerness": "high"}
    settings = session.settings
    assert settings.include_logprobs
    assert settings.live_transcription() == LiveTranscription("Dragons, castles.", logprobs=True)
    assert settings.turn_detection is not None and not settings.turn_detection.create_response


def test_a_beta_update_answers_in_the_beta_shape() -> None:
    session = transcription(beta=True)
    session.events_to_send()
    event = beta_update(
        session,
        input_audio_format="g711_alaw",
        input_audio_transcription={"model": "gpt-4o-mini-transcribe", "prompt": "Paris"},
        turn_detection={"type": "server_vad", "silence_duration_ms": 300},
        input_audio_noise_reduction=None,
        include=[LOGPROBS],
        modalities=["text"],
    )
    assert event["type"] == "transcription_session.updated"
    obj = event["session"]
    assert obj["input_audio_format"] == "g711_alaw" and obj["include"] == [LOGPROBS]
    assert obj["input_audio_transcription"]["prompt"] == "Paris"
    assert obj["turn_detection"]["silence_duration_ms"] == 300
    assert session.settings.live_transcription() == LiveTranscription("Paris", logprobs=True)


def test_transcription_can_be_turned_off_and_include_cleared() -> None:
    session = transcription()
    session.events_to_send()
    update(session, include=[LOGPROBS])
    obj = update(session, audio=audio_input(transcription=None), include=[])["session"]
    assert obj["audio"]["input"]["transcription"] is None and obj["include"] is None
    assert session.settings.live_transcription() is None


def test_manual_turns_in_a_transcription_session() -> None:
    session = transcription()
    session.events_to_send()
    update(session, audio=audio_input(turn_detection=None))
    session.actions()
    for _ in range(5):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    events = send(session, type="input_audio_buffer.commit")
    assert [e["type"] for e in events][:1] == ["input_audio_buffer.committed"]
    (job,) = [a for a in session.actions() if isinstance(a, StartResponse)]
    assert job.turn.final is Stage.ASR and not job.conversation


# ---- the session type is fixed --------------------------------------------------------


def test_a_realtime_session_does_not_become_a_transcription_session() -> None:
    session = RealtimeSession(config=GatewayConfig(), model="m", beta=False)
    session.events_to_send()
    (event,) = send(session, type="session.update", session={"type": "transcription"})
    assert event["type"] == "error" and event["error"]["param"] == "session.type"
    assert "?intent=transcription" in event["error"]["message"]
    assert session.settings.type == "realtime"


def test_a_transcription_session_does_not_become_a_realtime_session() -> None:
    session = transcription()
    session.events_to_send()
    (event,) = send(
        session, type="session.update", session={"type": "realtime", "instructions": "hi"}
    )
    assert event["type"] == "error" and event["error"]["param"] == "session.type"
    assert "transcription session" in event["error"]["message"]
    assert update(session)["session"]["type"] == "transcription"  # the session goes on


def test_beta_events_name_their_session_type() -> None:
    beta_transcription = transcription(beta=True)
    beta_transcription.events_to_send()
    (event,) = send(beta_transcription, type="session.update", session={})
    assert event["type"] == "error" and "transcription_session.update" in event["error"]["message"]
    beta_realtime = RealtimeSession(config=GatewayConfig(), model="m", beta=True)
    beta_realtime.events_to_send()
    (event,) = send(beta_realtime, type="transcription_session.update", session={})
    assert event["type"] == "error" and "?intent=transcription" in event["error"]["message"]
    ga = transcription()
    ga.events_to_send()
    (event,) = send(ga, type="transcription_session.update", session={"type": "transcription"})
    assert event["type"] == "error" and "use session.update" in event["error"]["message"]


# ---- refusals: one clear error each, and the session goes on --------------------------


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"instructions": "be brief"}, "session.instructions", "never responds"),
        ({"tools": []}, "session.tools", "never responds"),
        ({"output_modalities": ["text"]}, "session.output_modalities", "never responds"),
        ({"audio": {"output": {"voice": "joe"}}}, "session.audio.output", "never responds"),
        ({"model": "gpt-realtime"}, "session.model", "never responds"),
        ({"include": ["item.input_audio_transcription.segments"]}, "session.include.0", "only"),
        (
            {"audio": audio_input(noise_reduction={"type": "studio"})},
            "session.audio.input.noise_reduction.type",
            "near_field",
        ),
        (
            {"audio": audio_input(turn_detection={"type": "server_vad", "create_response": True})},
            "session.audio.input.turn_detection.create_response",
            "never responds",
        ),
        (
            {"audio": audio_input(turn_detection={"interrupt_response": True})},
            "session.audio.input.turn_detection.interrupt_response",
            "never responds",
        ),
        (
            {"audio": audio_input(turn_detection={"idle_timeout_ms": 5000})},
            "session.audio.input.turn_detection.idle_timeout_ms",
            "never responds",
        ),
        (
            {"audio": audio_input(transcription={"model": "gpt-4o-transcribe-diarize"})},
            "session.audio.input.transcription.model",
            "diarization",
        ),
        (
            {"audio": audio_input(transcription={"model": "nova-3"})},
            "session.audio.input.transcription.model",
            "whisper-1",
        ),
        (
            {"audio": audio_input(transcription={"language": "fr"})},
            "session.audio.input.transcription.language",
            "'fr' is not supported",
        ),
        (
            {"audio": audio_input(turn_detection={"type": "semantic_vad"})},
            "session.audio.input.turn_detection.type",
            "turn-end model",
        ),
    ],
)
def test_ga_refusals(fields: dict[str, Any], param: str, says: str) -> None:
    session = transcription()
    session.events_to_send()
    before = session.settings
    (event,) = send(
        session,
        type="session.update",
        session={"type": "transcription", **fields},
        event_id="evt_7",
    )
    assert event["type"] == "error", event
    assert event["error"]["param"] == param and event["error"]["event_id"] == "evt_7"
    assert says in event["error"]["message"]
    assert session.settings == before
    assert update(session, include=[LOGPROBS])["type"] == "session.updated"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"modalities": ["text", "audio"]}, "session.modalities"),
        ({"voice": "joe"}, "session.voice"),
        (
            {"input_audio_noise_reduction": {"type": "studio"}},
            "session.input_audio_noise_reduction.type",
        ),
        (
            {"input_audio_transcription": {"language": "de"}},
            "session.input_audio_transcription.language",
        ),
        ({"turn_detection": {"create_response": True}}, "session.turn_detection.create_response"),
        ({"input_audio_format": "mp3"}, "session.input_audio_format"),
    ],
)
def test_beta_refusals(fields: dict[str, Any], param: str) -> None:
    session = transcription(beta=True)
    session.events_to_send()
    event = beta_update(session, **fields)
    assert event["type"] == "error" and event["error"]["param"] == param, event
    assert beta_update(session, modalities=["text"])["type"] == "transcription_session.updated"


def test_include_and_prompt_in_a_realtime_session() -> None:
    session = RealtimeSession(config=GatewayConfig(), model="m", beta=False)
    session.events_to_send()
    words = {"model": "whisper-1", "prompt": "Brave little dragon."}
    realtime = {"type": "realtime", "audio": {"input": {"transcription": words}}}
    (event,) = send(session, type="session.update", session={**realtime, "include": [LOGPROBS]})
    assert event["session"]["include"] == [LOGPROBS]
    assert event["session"]["audio"]["input"]["transcription"]["prompt"] == "Brave little dragon."
    session.actions()
    speak(session)
    # The response's own speech-to-text takes the prompt and the logprobs.
    (start,) = [a for a in session.actions() if isinstance(a, StartResponse)]
    assert start.conversation and start.turn.audio is not None
    assert start.turn.transcription_prompt == "Brave little dragon." and start.turn.logprobs
    session.events_to_send()
    (event,) = send(session, type="session.update", session={"type": "realtime", "include": ["x"]})
    assert event["type"] == "error" and event["error"]["param"] == "session.include.0"


def test_a_transcription_turn_carries_the_sessions_options() -> None:
    clip = Clip(b"\0" * 4800, PCM16, np.zeros(1600, np.float32))
    item = Item.user_audio("item_1", clip)
    plain = transcription_turn(item, None)
    assert plain.transcription_prompt == "" and not plain.logprobs
    asked = transcription_turn(item, LiveTranscription("Paris", logprobs=True))
    assert asked.final is Stage.ASR and asked.audio == plain.audio
    assert asked.transcription_prompt == "Paris" and asked.logprobs


# ---- no responses ---------------------------------------------------------------------


def test_speech_is_committed_and_transcribed_never_answered() -> None:
    session = transcription()
    session.events_to_send()
    speak(session)
    events = session.events_to_send()
    kinds = [e["type"] for e in events]
    assert kinds == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    # The audio heard goes to the backend beside the turn.
    (job,) = [a for a in session.actions() if isinstance(a, StartResponse)]
    assert job.turn.final is Stage.ASR
    assert not job.conversation
    session.receive_response_event(ResponseOutput(job.response_id, "transcript", text="hi"))
    session.receive_response_event(ResponseDone(job.response_id, "completed"))
    kinds = [e["type"] for e in session.events_to_send()]
    assert kinds == [
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
    ]


def test_a_pause_prepares_the_transcription_the_stop_starts() -> None:
    session = transcription()
    session.events_to_send()
    for _ in range(10):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    session.actions()
    session.speech_started(200)
    session.speech_paused(900)
    (prepare,) = [a for a in session.actions() if isinstance(a, PrepareResponse)]
    assert prepare.turn.final is Stage.ASR and prepare.turn.utterance is not None
    session.speech_stopped(900)
    actions = session.actions()
    (job,) = [a for a in actions if isinstance(a, StartResponse)]
    assert not any(isinstance(a, DiscardPrepared) for a in actions)
    assert job.turn == prepare.turn  # equal turns: the job takes the prepared work over


@pytest.mark.parametrize("beta", [False, True])
def test_response_create_is_refused(beta: bool) -> None:
    session = transcription(beta=beta)
    session.events_to_send()
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    send(session, type="conversation.item.create", item=item)
    (event,) = send(session, type="response.create", event_id="evt_2")
    assert event["type"] == "error" and event["error"]["event_id"] == "evt_2"
    assert event["error"]["type"] == "invalid_request_error"
    assert "transcription session" in event["error"]["message"]
    assert not [a for a in session.actions() if isinstance(a, StartResponse)]


# ---- over the socket ------------------------------------------------------------------


@pytest.mark.parametrize("beta", [False, True])
async def test_intent_transcription_over_the_socket(beta: bool) -> None:
    backend = FakeBackend()
    server = await start_server(backend)
    headers = {"OpenAI-Beta": "realtime=v1"} if beta else {}
    created = "transcription_session.created" if beta else "session.created"
    try:
        path = "/v1/realtime?intent=transcription"
        async with connect(url(server, path), additional_headers=headers) as ws:
            (event,) = await recv(ws, created)
            assert event["session"]["object"] == "realtime.transcription_session"
            await send_audio(ws, [False] * 2 + [True] * 5 + [False] * 8)
            events = await recv(ws, "conversation.item.input_audio_transcription.completed")
            assert events[-1]["transcript"] == "fake transcript"
            assert not any(e["type"].startswith("response.") for e in events)
            (turn,) = backend.sessions[0].turns.values()
            assert turn.final is Stage.ASR
            await ws.send(json.dumps({"type": "response.create"}))
            (error,) = await recv(ws, "error")
            assert "transcription session" in error["error"]["message"]
    finally:
        await server.shutdown()


async def test_an_unknown_intent_is_refused_before_the_upgrade() -> None:
    server = await start_server()
    try:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url(server, "/v1/realtime?intent=quicksilver")):
                pass
        assert refused.value.response.status_code == 400
        assert b"invalid_intent" in refused.value.response.body
    finally:
        await server.shutdown()
