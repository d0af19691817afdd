"""Turn-taking with the real models: the official `openai` SDK (GA and beta) against
`duplex-gateway` started through its CLI, eSpeak NG as the speaker.

semantic_vad runs on the embedded Smart Turn model and the ASR stage; interruptions over
an answer are confirmed by their words or their length (configs/default.yaml).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import running_gateway
from tests.realtime_client import RATE, client, silence, speech, stream, until, words

pytestmark = pytest.mark.models

MODEL = "duplex-smollm2"


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with running_gateway() as gw:
        yield f"ws://127.0.0.1:{gw.port}/v1"


async def append(conn: Any, pcm: bytes) -> None:
    """Append `pcm` at once, in 100 ms pieces."""
    step = RATE * 2 // 10
    for i in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + step]).decode())


async def semantic_session(conn: Any, eagerness: str, **extra: Any) -> Any:
    detection = {"type": "semantic_vad", "eagerness": eagerness, **extra}
    await conn.session.update(
        session={
            "type": "realtime",
            "output_modalities": ["audio"],
            "audio": {
                "input": {
                    "transcription": {"model": "whisper-1"},
                    "turn_detection": detection,
                }
            },
        }
    )
    return (await until(conn, "session.updated"))[-1]


async def test_semantic_vad_ends_a_finished_sentence_before_its_longest_wait(
    gateway: str,
) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        updated = await semantic_session(conn, "low")
        detection = updated.session.audio.input.turn_detection
        assert detection.type == "semantic_vad" and detection.eagerness == "low"
        question = speech("Could you tell me what the weather will be like tomorrow in Paris?")
        # 5 s of silence after it: under eagerness low's 8 s, so only a turn the model
        # and the words call finished ends in it.
        await stream(conn, silence(200) + question + silence(5000))
        events = await until(conn, "response.done", timeout=180)
        kinds = [e.type for e in events]
        assert kinds.count("input_audio_buffer.speech_stopped") == 1
        assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
        assert "response.output_audio.delta" in kinds
        stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
        spoken_ms = 200 + len(question) * 1000 / (RATE * 2)
        assert stopped.audio_end_ms <= spoken_ms + 100


async def test_semantic_vad_in_the_beta_shape(gateway: str) -> None:
    async with client(gateway).beta.realtime.connect(model=MODEL) as conn:
        await conn.session.update(
            session={
                "modalities": ["text", "audio"],
                "input_audio_transcription": {"model": "whisper-1"},
                "turn_detection": {"type": "semantic_vad", "eagerness": "high"},
            }
        )
        updated = (await until(conn, "session.updated"))[-1]
        assert updated.session.turn_detection.type == "semantic_vad"
        assert updated.session.turn_detection.eagerness == "high"
        await append(conn, silence(200) + speech("What is the capital of France?") + silence(3000))
        events = await until(conn, "response.done", timeout=180)
        kinds = [e.type for e in events]
        assert "input_audio_buffer.speech_stopped" in kinds
        assert "conversation.item.created" in kinds and "response.audio.delta" in kinds
        said = next(
            e for e in events if e.type == "conversation.item.input_audio_transcription.completed"
        )
        assert {"capital", "france"} <= words(said.transcript), said.transcript


async def test_a_hesitation_does_not_end_the_turn(gateway: str) -> None:
    hesitant = speech(
        "I would like to book a table for <break time='900ms'/> two people at seven tonight."
    )
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await semantic_session(conn, "auto")
        await stream(conn, silence(200) + hesitant + silence(4500))
        events = await until(conn, "response.done", timeout=180)
        kinds = [e.type for e in events]
        assert kinds.count("input_audio_buffer.speech_stopped") == 1, kinds
        assert kinds.count("input_audio_buffer.committed") == 1
        said = next(
            e for e in events if e.type == "conversation.item.input_audio_transcription.completed"
        )
        assert {"table", "seven"} <= words(said.transcript), said.transcript


async def answer_underway(conn: Any) -> str:
    await conn.conversation.item.create(
        item={
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Tell me a long story about a dragon."}],
        }
    )
    await conn.response.create()
    events = await until(conn, "response.output_audio.delta", "response.done")
    assert events[-1].type == "response.output_audio.delta"
    return events[-1].response_id


async def test_a_backchannel_does_not_cancel_an_answer_and_an_interruption_does(
    gateway: str,
) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
            }
        )
        await until(conn, "session.updated")
        response_id = await answer_underway(conn)
        await append(conn, speech("mm hmm") + silence(1500))
        events = await until(conn, "response.done", timeout=180)
        kinds = [e.type for e in events]
        assert "input_audio_buffer.speech_started" not in kinds
        assert events[-1].response.id == response_id
        # It ran to its end (or its token limit: a long story is "incomplete").
        assert events[-1].response.status in ("completed", "incomplete")

        response_id = await answer_underway(conn)
        await append(conn, speech("Wait, stop, I have a different question.") + silence(1500))
        events = await until(conn, "response.done", timeout=180)
        started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
        assert events[-1].response.id == response_id
        assert events[-1].response.status == "cancelled"
        assert events[-1].response.status_details.reason == "turn_detected"
        # The interruption is a turn of its own: its answer comes, and no audio of the
        # cancelled answer after that answer's response.done.
        after = await until(conn, "response.done", timeout=180)
        assert not [
            e
            for e in after
            if e.type == "response.output_audio.delta" and e.response_id == response_id
        ]
        committed = next(e for e in after if e.type == "input_audio_buffer.committed")
        assert committed.item_id == started.item_id


async def test_refused_semantic_settings_through_the_sdk(gateway: str) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        for detection, param in [
            ({"type": "semantic_vad", "eagerness": "eager"}, "eagerness"),
            ({"type": "semantic_vad", "silence_duration_ms": 200}, "silence_duration_ms"),
        ]:
            await conn.session.update(
                session={"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
            )
            error = (await until(conn, "error"))[-1].error
            assert error.param.endswith(param), error
        # The session goes on.
        await semantic_session(conn, "medium")
