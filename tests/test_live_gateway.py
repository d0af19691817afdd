"""Live transcription in the gateway, with fakes: the realtime core hears every sample,
names the speech under way by its item id, sends each `TranscriptDelta` at once, and
completes the item's transcript with only the rest; the engine backend turns these
into appends on the duplex session's resident request and its deltas back into
`TranscriptDelta`s."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from duplex.contracts import DuplexFence, duplex_resource_request_id
from duplex.manager import DuplexSessionManager
from duplex.session import RESIDENT_ROLE
from gateway.config import GatewayConfig
from gateway.protocol.audio import PCM16
from gateway.session.actions import (
    CancelResponse,
    EndUtterance,
    Hear,
    Listen,
    StartResponse,
    StartUtterance,
)
from gateway.session.backend import (
    LiveTranscription,
    ResponseDone,
    ResponseOutput,
    TokenLogprob,
    TranscriptDelta,
)
from gateway.session.engine_backend import EngineBackendSession
from gateway.session.realtime import RealtimeSession
from tests.fakes import FakeStagePort

TRANSCRIBED = {"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}


def send(rt: RealtimeSession, /, **event: object) -> list[dict]:
    rt.receive_text(json.dumps(event))
    return rt.events_to_send()


def tone_b64(ms: int) -> str:
    t = np.arange(int(PCM16.rate * ms / 1000)) / PCM16.rate
    return base64.b64encode(PCM16.encode(0.3 * np.sin(2 * np.pi * 220 * t))).decode()


def listening() -> RealtimeSession:
    session = RealtimeSession(config=GatewayConfig(), model="m", beta=False)
    send(session, type="session.update", session=TRANSCRIBED)
    return session


def speaking(session: RealtimeSession) -> str:
    for _ in range(10):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    session.speech_started(200)
    (started,) = session.events_to_send()
    return str(started["item_id"])


def test_a_transcribed_session_listens_and_hears_every_sample() -> None:
    session = RealtimeSession(config=GatewayConfig(), model="m", beta=False)
    session.actions()
    send(session, type="session.update", session=TRANSCRIBED)
    assert Listen(LiveTranscription()) in session.actions()
    for _ in range(10):
        send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    actions = session.actions()
    heard = [a.samples for a in actions if isinstance(a, Hear)]
    # Every sample once, for server VAD and live transcription alike.
    assert 16_000 - 800 < sum(len(s) for s in heard) <= 16_000  # the resampler lags a little
    update = {"type": "realtime", "audio": {"input": {"transcription": None}}}
    send(session, type="session.update", session=update)
    assert Listen(None) in session.actions()


def test_deltas_go_out_before_the_stop_and_the_final_sends_only_the_rest() -> None:
    session = listening()
    item_id = speaking(session)
    assert StartUtterance(item_id, 200) in session.actions()
    logprob = TokenLogprob("Hello", -0.1, tuple(b"Hello"))
    session.receive_response_event(TranscriptDelta(item_id, "Hello", (logprob,)))
    session.receive_response_event(TranscriptDelta(item_id, " there"))
    deltas = session.events_to_send()
    assert [e["type"] for e in deltas] == ["conversation.item.input_audio_transcription.delta"] * 2
    assert [(e["item_id"], e["content_index"], e["delta"]) for e in deltas] == [
        (item_id, 0, "Hello"),
        (item_id, 0, " there"),
    ]
    assert deltas[0]["logprobs"] == [{"token": "Hello", "logprob": -0.1, "bytes": list(b"Hello")}]
    assert "logprobs" not in deltas[1]
    session.speech_stopped(900)
    actions = session.actions()
    (start,) = [a for a in actions if isinstance(a, StartResponse)]
    assert start.turn.utterance == item_id
    # The utterance ends after the turn that finishes its transcript was started.
    assert actions.index(start) < actions.index(EndUtterance(item_id))
    session.events_to_send()
    final = ResponseOutput(start.response_id, "transcript", text="Hello there, friend.")
    session.receive_response_event(final)
    rest, completed = session.events_to_send()
    assert rest["type"] == "conversation.item.input_audio_transcription.delta"
    assert rest["delta"] == ", friend."
    assert completed["type"] == "conversation.item.input_audio_transcription.completed"
    assert completed["transcript"] == "Hello" + " there" + rest["delta"]
    assert session.conversation.get(item_id).text() == "Hello there, friend."  # type: ignore[union-attr]


def test_a_transcript_with_logprobs_completes_with_them() -> None:
    session = listening()
    item_id = speaking(session)
    session.receive_response_event(TranscriptDelta(item_id, "Hi"))
    session.speech_stopped(900)
    (start,) = [a for a in session.actions() if isinstance(a, StartResponse)]
    session.events_to_send()
    tokens = (TokenLogprob("Hi", -0.5, tuple(b"Hi")), TokenLogprob(" you", -0.2, tuple(b" you")))
    session.receive_response_event(
        ResponseOutput(start.response_id, "transcript", text="Hi you", logprobs=tokens)
    )
    rest, completed = session.events_to_send()
    assert rest["delta"] == " you" and [t["token"] for t in rest["logprobs"]] == [" you"]
    assert [t["token"] for t in completed["logprobs"]] == ["Hi", " you"]


def test_a_barge_in_starts_the_utterance_after_the_cancel() -> None:
    session = listening()
    send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
    send(session, type="conversation.item.create", item=item)
    send(session, type="response.create")
    (start,) = [a for a in session.actions() if isinstance(a, StartResponse)]
    item_id = speaking(session)
    actions = [a for a in session.actions() if not isinstance(a, Hear)]
    assert actions == [
        CancelResponse(start.response_id, "turn_detected"),
        StartUtterance(item_id, 200),
    ]
    session.receive_response_event(ResponseDone(start.response_id, "cancelled", "turn_detected"))


def test_speech_that_is_dropped_ends_its_utterance() -> None:
    session = listening()
    item_id = speaking(session)
    session.actions()
    send(session, type="input_audio_buffer.clear")
    assert EndUtterance(item_id) in session.actions()
    item_id = speaking(session)
    session.actions()
    send(session, type="input_audio_buffer.commit")  # a manual commit mid-speech
    assert EndUtterance(item_id) in session.actions()


def test_without_transcription_no_delta_goes_out() -> None:
    session = RealtimeSession(config=GatewayConfig(), model="m", beta=False)
    session.events_to_send()
    item_id = speaking(session)
    session.receive_response_event(TranscriptDelta(item_id, "Hello"))
    assert session.events_to_send() == []


@pytest.fixture
def port() -> FakeStagePort:
    return FakeStagePort()


async def test_a_session_not_listening_sends_no_audio_but_keeps_the_clock(
    port: FakeStagePort,
) -> None:
    manager = DuplexSessionManager(port, max_sessions=1)
    session = EngineBackendSession(manager.open("s"))
    for _ in range(5):
        session.hear(np.zeros(640, np.float32))
    await manager.get("s").settled()  # type: ignore[union-attr]
    assert port.submitted == []  # no frame went down
    session.listen(LiveTranscription())
    session.hear(np.zeros(640, np.float32))
    await manager.get("s").settled()  # type: ignore[union-attr]
    listen, heard = (dict(s.prompt) for s in port.submitted)
    assert (listen["append"], listen["clock"], heard["append"]) == ("listen", 5 * 640, "heard")


async def test_heard_audio_goes_down_a_vad_window_at_a_time_and_before_any_other_append(
    port: FakeStagePort,
) -> None:
    manager = DuplexSessionManager(port, max_sessions=1)
    session = EngineBackendSession(manager.open("s"))
    session.listen(LiveTranscription())
    frames = [np.full(320, n, np.float32) for n in range(4)]  # 20 ms each
    frames.append(np.full(100, 4, np.float32))  # ends short of the window at 1536
    for frame in frames[:4]:
        session.hear(frame)
    session.utterance_started("item_1", 60.0)
    session.hear(frames[4])
    await manager.get("s").settled()  # type: ignore[union-attr]
    prompts = [dict(s.prompt) for s in port.submitted]
    assert [p["append"] for p in prompts] == ["listen", "heard", "heard", "utterance_started"]
    # Windows end at 512 and 1024 samples: frames 0-1 (640), then 2-3 (1280); the last
    # frame waits for the next window; the utterance start takes none of it ahead of it.
    sent = [np.frombuffer(p["audio"], "<f4") for p in prompts[1:3]]
    assert [len(s) for s in sent] == [640, 640]
    assert np.array_equal(np.concatenate(sent), np.concatenate(frames[:4]))
    session.watch_words()
    await manager.get("s").settled()  # type: ignore[union-attr]
    last, watch = (dict(s.prompt) for s in port.submitted[-2:])
    assert (last["append"], len(last["audio"]), watch["append"]) == (
        "heard",
        100 * 4,
        "watch_words",
    )
    await session.close()


async def test_the_engine_backend_appends_to_the_resident_request(port: FakeStagePort) -> None:
    manager = DuplexSessionManager(port, max_sessions=1)
    session = EngineBackendSession(manager.open("s"))
    session.listen(LiveTranscription(prompt="Ada", logprobs=True))
    session.hear(np.zeros(640, np.float32))
    session.hear(np.zeros(0, np.float32))  # nothing heard: no append
    session.utterance_started("item_1", 12.5)
    session.utterance_ended("item_1")
    session.listen(None)
    await manager.get("s").settled()  # type: ignore[union-attr]
    rid = duplex_resource_request_id(DuplexFence("s"), RESIDENT_ROLE)
    prompts = [dict(s.prompt) for s in port.submitted]
    assert [p["append"] for p in prompts] == [
        "listen",
        "heard",
        "utterance_started",
        "utterance_ended",
        "listen",
    ]
    assert (prompts[0]["prompt"], prompts[0]["logprobs"], prompts[-1]["enabled"]) == (
        "Ada",
        True,
        False,
    )
    assert len(prompts[1]["audio"]) == 640 * 4
    assert all(s.context.request_id == rid for s in port.submitted)
    port.push(rid, "transcript_delta", "Hi", utterance_id="item_1", logprobs=(("Hi", -0.5),))
    (delta,) = session.take_events()
    assert delta == TranscriptDelta("item_1", "Hi", (TokenLogprob("Hi", -0.5, tuple(b"Hi")),))
    await session.close()
    session.hear(np.zeros(640, np.float32))  # after close: dropped, no error
    assert port.reserved == []
