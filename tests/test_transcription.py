"""Committed user audio is transcribed when it is committed, not only when a response
answers it: manual commits, and server VAD with `create_response: false`."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from duplex.turn import Stage
from engine.config import parse_config
from gateway.config import GatewayConfig
from gateway.session.actions import CancelResponse, StartResponse
from gateway.session.backend import ResponseDone, ResponseOutput
from gateway.session.realtime import RealtimeSession
from tests.fake_engine import Harness, audio, turn
from tests.helpers import pcm16, read_audio, running_gateway, tone_b64


def starts(actions: list[Any]) -> list[StartResponse]:
    """The turns among `actions` (the audio heard goes to the backend beside them)."""
    return [a for a in actions if isinstance(a, StartResponse)]


RECORDING = Path("/usr/share/sounds/alsa/Front_Center.wav")
TRANSCRIBED = {"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}


# ---- the orchestrator: a turn that ends at stage 0 ----------------------------------


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness(parse_config({}))
    yield harness
    harness.core.shutdown()


async def test_a_transcription_turn_runs_only_the_asr_stage(h: Harness) -> None:
    contexts = h.reserve(final=0)
    await h.submit(contexts, turn(Stage.ASR, audio=audio(6)))
    rid = contexts[0].request_id
    await h.until(lambda: h.finished(rid))
    assert [(o.kind, o.text, o.finished) for o in h.outputs] == [
        ("transcript", "question 6", False),
        ("done", "", True),
    ]
    assert not h.llm.inputs and not h.tts.requests
    await h.idle()


def test_a_transcription_turn_takes_audio_alone() -> None:
    with pytest.raises(ValueError, match="takes audio alone"):
        turn(Stage.ASR, audio=audio(1), messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="cannot end at ASR"):
        turn(Stage.ASR, text="hello")


# ---- the realtime session -------------------------------------------------------------


def _session(update: dict[str, Any]) -> RealtimeSession:
    session = RealtimeSession(config=GatewayConfig(), model="m", beta=False)
    session.receive_text(json.dumps({"type": "session.update", "session": update}))
    session.events_to_send()
    session.actions()
    return session


def _send(session: RealtimeSession, **event: Any) -> list[dict[str, Any]]:
    session.receive_text(json.dumps(event))
    return session.events_to_send()


def _transcribed(session: RealtimeSession, job: StartResponse, words: str) -> None:
    session.receive_response_event(ResponseOutput(job.response_id, "transcript", text=words))
    session.receive_response_event(ResponseDone(job.response_id, "completed"))


def _manual_session() -> RealtimeSession:
    update = json.loads(json.dumps(TRANSCRIBED))
    update["audio"]["input"]["turn_detection"] = None
    return _session(update)


def test_a_manual_commit_is_transcribed_without_a_response() -> None:
    session = _manual_session()
    _send(session, type="input_audio_buffer.append", audio=tone_b64(300))
    events = _send(session, type="input_audio_buffer.commit")
    item_id = events[0]["item_id"]
    (job,) = starts(session.actions())
    assert isinstance(job, StartResponse) and not job.conversation
    assert job.turn.final is Stage.ASR and job.turn.audio is not None
    _transcribed(session, job, "hello there")
    events = session.events_to_send()
    assert [e["type"] for e in events] == [
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
    ]
    assert events[1]["item_id"] == item_id and events[1]["transcript"] == "hello there"
    # The words are in the conversation: a response answers them as text, no ASR again.
    _send(session, type="response.create")
    (start,) = session.actions()
    assert isinstance(start, StartResponse) and start.conversation
    assert start.turn.entry is Stage.LLM and start.turn.text == "hello there"


def test_each_commit_keeps_its_words_for_later_responses() -> None:
    session = _manual_session()
    jobs = []
    for words in ("first thing", "second thing"):
        _send(session, type="input_audio_buffer.append", audio=tone_b64(300))
        _send(session, type="input_audio_buffer.commit")
        (job,) = starts(session.actions())
        assert isinstance(job, StartResponse)
        _transcribed(session, job, words)
        jobs.append(job)
    _send(session, type="response.create")
    (start,) = session.actions()
    assert isinstance(start, StartResponse)
    assert start.turn.text == "second thing"
    assert start.turn.messages[-1].content == "first thing"


def test_a_failed_transcription_is_reported_on_its_item() -> None:
    session = _manual_session()
    _send(session, type="input_audio_buffer.append", audio=tone_b64(300))
    item_id = _send(session, type="input_audio_buffer.commit")[0]["item_id"]
    (job,) = starts(session.actions())
    assert isinstance(job, StartResponse)
    session.receive_response_event(
        ResponseDone(job.response_id, "failed", reason="error", error="asr exploded")
    )
    (event,) = session.events_to_send()
    assert event["type"] == "conversation.item.input_audio_transcription.failed"
    assert event["item_id"] == item_id and event["error"]["message"] == "asr exploded"


def test_deleting_the_item_stops_its_transcription() -> None:
    session = _manual_session()
    _send(session, type="input_audio_buffer.append", audio=tone_b64(300))
    item_id = _send(session, type="input_audio_buffer.commit")[0]["item_id"]
    (job,) = starts(session.actions())
    assert isinstance(job, StartResponse)
    _send(session, type="conversation.item.delete", item_id=item_id)
    assert session.actions() == [CancelResponse(job.response_id, "superseded")]
    # The layer below ends the job; nothing of it reaches the client.
    session.receive_response_event(ResponseDone(job.response_id, "cancelled", reason="superseded"))
    assert session.events_to_send() == []


def test_server_vad_without_create_response_transcribes_the_turn() -> None:
    update = json.loads(json.dumps(TRANSCRIBED))
    update["audio"]["input"]["turn_detection"] = {"type": "server_vad", "create_response": False}
    session = _session(update)
    for _ in range(10):
        _send(session, type="input_audio_buffer.append", audio=tone_b64(100))
    session.actions()
    session.speech_started(200)
    session.speech_stopped(900)
    (job,) = starts(session.actions())
    assert isinstance(job, StartResponse) and job.turn.final is Stage.ASR
    assert job.turn.audio is not None
    assert abs(len(job.turn.audio) / 4 - 0.7 * 16000) < 100


# ---- for real --------------------------------------------------------------------------


def _recording() -> str:
    return base64.b64encode(pcm16(read_audio(RECORDING, 24000))).decode()


async def _until(ws: Any, kind: str) -> dict[str, Any]:
    async with asyncio.timeout(120):
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "error":
                raise AssertionError(event)
            if event["type"] == kind:
                return event


@pytest.mark.models
async def test_a_real_manual_commit_is_transcribed_then_answered() -> None:
    update = json.loads(json.dumps(TRANSCRIBED))
    update["audio"]["input"]["turn_detection"] = None
    update["output_modalities"] = ["text"]
    with running_gateway() as gw:
        url = f"ws://127.0.0.1:{gw.port}/v1/realtime?model=duplex-smollm2"
        async with connect(url, max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _recording()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            committed = await _until(ws, "input_audio_buffer.committed")
            done = await _until(ws, "conversation.item.input_audio_transcription.completed")
            assert done["item_id"] == committed["item_id"]
            assert "front" in done["transcript"].lower()
            # The answer builds on the transcribed words.
            await ws.send(json.dumps({"type": "response.create"}))
            response = await _until(ws, "response.done")
            # "incomplete" when the answer runs into the profile's max_tokens
            assert response["response"]["status"] in ("completed", "incomplete")
            assert response["response"]["usage"]["output_tokens"] > 0
            [item] = response["response"]["output"]
            assert item["content"][0]["text"].strip()
