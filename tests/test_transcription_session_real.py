"""Transcription sessions with the real models: the official `openai` SDK (GA and beta)
against `duplex-gateway` started through its CLI, eSpeak NG speaking at a microphone's
pace (40 ms frames in real time, then silence).

Live deltas come from the resident speech-to-text while the user speaks; the tests that
look for them before `speech_stopped` need that path in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import espeak, pcm16, running_gateway
from tests.realtime_client import RATE, client, silence, stream, until, words

pytestmark = pytest.mark.models

LOGPROBS = "item.input_audio_transcription.logprobs"
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank this morning."
INTENT = {"intent": "transcription"}


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with running_gateway() as gw:
        yield f"ws://127.0.0.1:{gw.port}/v1"


@pytest.fixture(scope="module")
def sentence() -> bytes:
    """PCM16 24 kHz of eSpeak NG saying `SENTENCE`, between silences."""
    return silence(300) + pcm16(espeak(SENTENCE, RATE, "-v", "en-us")) + silence(1500)


async def transcribe(conn: Any, pcm: bytes) -> list[Any]:
    """Stream `pcm` while reading; every event up to the transcript's `.completed`."""
    streaming = asyncio.create_task(stream(conn, pcm))
    try:
        events = await until(conn, "conversation.item.input_audio_transcription.completed")
    finally:
        await streaming
    return events


async def ga_session(conn: Any, **extra: Any) -> Any:
    (created,) = await until(conn, "session.created")
    assert created.session.type == "transcription"
    transcription = {"model": "gpt-4o-transcribe", "language": "en", "prompt": "A fox and a dog."}
    await conn.session.update(
        session={
            "type": "transcription",
            "audio": {
                "input": {
                    "transcription": transcription,
                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
                }
            },
            **extra,
        }
    )
    return (await until(conn, "session.updated"))[-1]


def of_type(events: list[Any], kind: str) -> list[Any]:
    return [e for e in events if e.type == kind]


def check_transcript(events: list[Any]) -> tuple[list[Any], Any]:
    """The deltas and the completed event of the one utterance; they must agree."""
    (completed,) = of_type(events, "conversation.item.input_audio_transcription.completed")
    deltas = of_type(events, "conversation.item.input_audio_transcription.delta")
    assert deltas and all(d.item_id == completed.item_id for d in deltas)
    assert "".join(d.delta for d in deltas) == completed.transcript
    # Whisper tiny.en hears eSpeak's "brown fox" its own way; the rest it gets.
    assert {"quick", "lazy", "dog", "river", "bank"} <= words(completed.transcript), completed
    assert not [e for e in events if e.type.startswith("response.")]
    return deltas, completed


async def refuse_response(conn: Any) -> None:
    """`response.create` gets an error; no response ever starts (the error is the next
    event after the transcript, and events arrive in order)."""
    await conn.response.create()
    (error,) = await until(conn, "error", "response.created")
    assert error.type == "error" and "transcription session" in error.error.message


def kinds_before_stop(events: list[Any]) -> list[str]:
    kinds = [e.type for e in events]
    return kinds[: kinds.index("input_audio_buffer.speech_stopped")]


# ---- GA -------------------------------------------------------------------------------


async def test_a_ga_transcription_session_transcribes_and_never_responds(
    gateway: str, sentence: bytes
) -> None:
    async with client(gateway).realtime.connect(extra_query=INTENT) as conn:
        updated = await ga_session(conn)
        assert updated.session.type == "transcription"
        assert updated.session.audio.input.transcription.model == "gpt-4o-transcribe"
        events = await transcribe(conn, sentence)
        kinds = [e.type for e in events]
        assert kinds.index("input_audio_buffer.speech_started") < kinds.index(
            "input_audio_buffer.committed"
        )
        check_transcript(events)
        await refuse_response(conn)


async def test_ga_deltas_arrive_while_the_user_speaks(gateway: str, sentence: bytes) -> None:
    async with client(gateway).realtime.connect(extra_query=INTENT) as conn:
        await ga_session(conn)
        events = await transcribe(conn, sentence)
        assert "conversation.item.input_audio_transcription.delta" in kinds_before_stop(events)
        check_transcript(events)


async def test_logprobs_come_when_included(gateway: str, sentence: bytes) -> None:
    async with client(gateway).realtime.connect(extra_query=INTENT) as conn:
        updated = await ga_session(conn, include=[LOGPROBS])
        assert updated.session.include == [LOGPROBS]
        events = await transcribe(conn, sentence)
        deltas, completed = check_transcript(events)
        assert completed.logprobs and all(d.logprobs for d in deltas)
        assert "".join(p.token for p in completed.logprobs).strip() == completed.transcript.strip()
        assert all(p.logprob <= 0 for p in completed.logprobs)


# ---- beta -----------------------------------------------------------------------------


async def beta_session(conn: Any) -> None:
    (created,) = await until(conn, "transcription_session.created")
    await conn.transcription_session.update(
        session={
            "input_audio_format": "pcm16",
            "input_audio_transcription": {"model": "whisper-1", "language": "en"},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
        }
    )
    (updated,) = await until(conn, "transcription_session.updated")
    assert updated.session.input_audio_transcription.model == "whisper-1"


async def test_a_beta_intent_transcription_session_transcribes_and_never_responds(
    gateway: str, sentence: bytes
) -> None:
    async with client(gateway).beta.realtime.connect(
        model="gpt-4o-transcribe", extra_query=INTENT
    ) as conn:
        await beta_session(conn)
        events = await transcribe(conn, sentence)
        check_transcript(events)
        await refuse_response(conn)


async def test_beta_deltas_arrive_while_the_user_speaks(gateway: str, sentence: bytes) -> None:
    async with client(gateway).beta.realtime.connect(
        model="gpt-4o-transcribe", extra_query=INTENT
    ) as conn:
        await beta_session(conn)
        events = await transcribe(conn, sentence)
        assert "conversation.item.input_audio_transcription.delta" in kinds_before_stop(events)
        check_transcript(events)


async def test_semantic_vad_commits_for_transcription_only(gateway: str, sentence: bytes) -> None:
    async with client(gateway).realtime.connect(extra_query=INTENT) as conn:
        await until(conn, "session.created")
        detection = {"type": "semantic_vad", "eagerness": "high"}
        await conn.session.update(
            session={"type": "transcription", "audio": {"input": {"turn_detection": detection}}}
        )
        (updated,) = await until(conn, "session.updated")
        assert updated.session.audio.input.turn_detection.type == "semantic_vad"
        events = await transcribe(conn, sentence)
        check_transcript(events)
        await refuse_response(conn)
