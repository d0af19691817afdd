"""The realtime core decides when to prepare a response: a pause in speech prepares the
turn the stop would start, and the stop starts exactly that turn (an equal value)."""

from __future__ import annotations

import base64
import json
from dataclasses import fields
from typing import Any, TypeVar

import numpy as np
import pytest

from duplex.turn import Stage
from engine.listening.speech_detector import SpeechDetector
from gateway.config import GatewayConfig
from gateway.protocol.audio import PCM16
from gateway.session.actions import ConfigureVad, DiscardPrepared, PrepareResponse, StartResponse
from gateway.session.realtime import RealtimeSession

A = TypeVar("A")


def _tone_b64(ms: int) -> str:
    t = np.arange(int(PCM16.rate * ms / 1000)) / PCM16.rate
    return base64.b64encode(PCM16.encode(0.3 * np.sin(2 * np.pi * 220 * t))).decode()


def _speaking_session(**config: Any) -> RealtimeSession:
    session = RealtimeSession(config=GatewayConfig(**config), model="m", beta=False)
    for _ in range(10):
        session.receive_text(
            json.dumps({"type": "input_audio_buffer.append", "audio": _tone_b64(100)})
        )
    session.speech_started(200)
    session.events_to_send()
    return session


def _actions(session: RealtimeSession, kind: type[A]) -> list[A]:
    return [a for a in session.actions() if isinstance(a, kind)]


def test_a_pause_prepares_exactly_the_turn_the_stop_starts() -> None:
    session = _speaking_session()
    configure = _actions(
        RealtimeSession(config=GatewayConfig(), model="m", beta=False), ConfigureVad
    )
    assert configure[0].pause_after_ms == GatewayConfig().prepare_after_silence_ms
    session.speech_paused(900)
    assert session.events_to_send() == []  # nothing the client sees
    (prepare,) = _actions(session, PrepareResponse)
    assert (prepare.turn.entry, prepare.turn.final) == (Stage.ASR, Stage.TTS)
    session.speech_stopped(900)
    actions = session.actions()
    (start,) = [a for a in actions if isinstance(a, StartResponse)]
    assert not any(isinstance(a, DiscardPrepared) for a in actions)
    assert start.conversation
    assert start.turn == prepare.turn
    assert prepare.turn.audio is not None
    assert abs(len(prepare.turn.audio) / 4 - 0.7 * 16000) < 100


def test_the_turn_names_its_utterance_and_the_words_stay_below() -> None:
    # The engine heard the speech and keeps its words: the turn names the utterance
    # (the speech's item) and its audio, and carries no words back down.
    session = RealtimeSession(config=GatewayConfig(), model="m", beta=False)
    for _ in range(10):
        session.receive_text(
            json.dumps({"type": "input_audio_buffer.append", "audio": _tone_b64(100)})
        )
    session.speech_started(200)
    (started,) = [e for e in session.events_to_send() if e["type"].endswith("speech_started")]
    session.speech_paused(900)
    (prepare,) = _actions(session, PrepareResponse)
    assert prepare.turn.utterance == started["item_id"]
    assert prepare.turn.audio is not None  # the item keeps its audio
    assert "heard" not in {f.name for f in fields(prepare.turn)}
    session.speech_stopped(900)
    (start,) = _actions(session, StartResponse)
    assert start.turn == prepare.turn  # the stop takes the prepared turn over


def test_speech_going_on_discards_the_prepared_response() -> None:
    session = _speaking_session()
    session.speech_paused(600)
    assert _actions(session, PrepareResponse)
    session.speech_resumed()
    assert _actions(session, DiscardPrepared) == [DiscardPrepared()]
    session.speech_paused(900)
    (prepare,) = _actions(session, PrepareResponse)
    session.speech_stopped(900)
    (start,) = _actions(session, StartResponse)
    assert start.turn == prepare.turn


def test_a_stop_that_creates_no_response_prepares_nothing() -> None:
    session = _speaking_session()
    update = {
        "type": "realtime",
        "audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}},
    }
    session.receive_text(json.dumps({"type": "session.update", "session": update}))
    session.actions()
    session.speech_started(1000)  # detection restarted: a new speech
    session.speech_paused(1100)
    assert _actions(session, PrepareResponse) == []  # the stop would not respond


def test_clearing_the_buffer_discards_it() -> None:
    session = _speaking_session()
    session.speech_paused(900)
    session.actions()
    session.receive_text(json.dumps({"type": "input_audio_buffer.clear"}))
    assert _actions(session, DiscardPrepared) == [DiscardPrepared()]


def test_preparation_can_be_turned_off() -> None:
    session = _speaking_session(prepare_after_silence_ms=None)
    session.speech_paused(900)
    assert _actions(session, PrepareResponse) == []


def test_the_detector_reports_pauses_before_the_stop() -> None:
    # 32 ms chunks: speech, 5 silent chunks (160 ms: a pause), speech, then a stop.
    detector = SpeechDetector(prefix_padding_ms=0, silence_duration_ms=320, pause_after_ms=150)
    events = detector.push([0.9] * 5 + [0.0] * 5 + [0.9] * 3 + [0.0] * 11)
    assert [type(e).__name__ for e in events] == [
        "SpeechStarted",
        "SpeechPaused",
        "SpeechResumed",
        "SpeechPaused",
        "SpeechStopped",
    ]
    assert events[1].audio_end_ms == 160 and events[3].audio_end_ms == events[4].audio_end_ms
    # A pause as long as the stop's silence never comes before it.
    late = SpeechDetector(silence_duration_ms=320, pause_after_ms=320)
    assert late.pause_after_ms is None
    with pytest.raises(ValueError, match="pause_after_ms"):
        SpeechDetector(pause_after_ms=-1)
