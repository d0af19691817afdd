"""Live transcription with the real models: the official `openai` SDK against
`duplex-gateway` started through its CLI, eSpeak NG speech paced in real time.

While the user speaks, `conversation.item.input_audio_transcription.delta` events come
before `speech_stopped`; their concatenation is exactly `.completed`'s transcript; a
voice turn is answered from that transcript; speech over a running answer cancels it
and is transcribed live the same way, with no audio of the cancelled answer after its
`response.done`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.build import MAIN_LANE_YIELDS
from tests.helpers import GatewayProcess, running_gateway
from tests.realtime_client import client, silence, speech, stream, until, words

pytestmark = pytest.mark.models

MODEL = "duplex-smollm2"
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
LONG_QUESTION = (
    "Could you please tell me what the capital city of France is, and also how many "
    "people live there today?"
)


@pytest.fixture(scope="module")
def process() -> Iterator[GatewayProcess]:
    with running_gateway() as gw:
        yield gw
    assert gw.proc.returncode == 0, "SIGTERM must shut down cleanly:\n" + "".join(gw.lines[-30:])


@pytest.fixture
def gateway(process: GatewayProcess) -> str:
    return f"ws://127.0.0.1:{process.port}/v1"


async def speak_and_read(conn: Any, pcm: bytes, *kinds: str) -> list[Any]:
    """Stream `pcm` in real time while reading events up to the first of `kinds`."""
    speaking = asyncio.create_task(stream(conn, pcm))
    try:
        return await until(conn, *kinds)
    finally:
        await speaking


def check_live_transcript(events: list[Any]) -> str:
    """The deltas of the one transcribed item came before its speech stopped and add up
    exactly to its completed transcript, which is returned."""
    kinds = [e.type for e in events]
    stopped = kinds.index("input_audio_buffer.speech_stopped")
    completed = next(e for e in events if e.type == COMPLETED)
    deltas = [e for e in events if e.type == DELTA and e.item_id == completed.item_id]
    assert any(events.index(d) < stopped for d in deltas), "no delta before speech_stopped"
    assert "".join(d.delta for d in deltas) == completed.transcript
    return str(completed.transcript)


async def test_deltas_come_while_speaking_and_add_up_to_the_completed_transcript(
    gateway: str,
) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["text"],
                "audio": {
                    "input": {
                        "transcription": {"model": "whisper-1"},
                        "turn_detection": {"type": "server_vad", "create_response": False},
                    }
                },
            }
        )
        await until(conn, "session.updated")
        events = await speak_and_read(
            conn, silence(300) + speech(LONG_QUESTION) + silence(1200), COMPLETED
        )
        transcript = check_live_transcript(events)
        assert {"capital", "france", "people"} <= words(transcript), transcript
        assert "response.created" not in [e.type for e in events]


async def test_a_voice_turn_is_answered_from_the_streamed_transcript(gateway: str) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["text"],
                "audio": {
                    "input": {
                        "transcription": {"model": "whisper-1"},
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
                    }
                },
            }
        )
        await until(conn, "session.updated")
        events = await speak_and_read(
            conn, silence(300) + speech(LONG_QUESTION) + silence(1500), "response.done"
        )
        transcript = check_live_transcript(events)
        assert {"capital", "france"} <= words(transcript), transcript
        # The reply came after the transcript was complete, from the item it completed.
        kinds = [e.type for e in events]
        assert kinds.index(COMPLETED) < kinds.index("response.output_text.delta")
        answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert answer.strip() and events[-1].response.status in ("completed", "incomplete")
        item = events[-1].response.output[0]
        assert item.role == "assistant"


async def test_speech_over_an_answer_cancels_it_and_is_transcribed_live(gateway: str) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {
                    "input": {
                        "transcription": {"model": "whisper-1"},
                        "turn_detection": {
                            "type": "server_vad",
                            "create_response": False,
                            "interrupt_response": True,
                        },
                    }
                },
            }
        )
        await until(conn, "session.updated")
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Tell me a long story about a dragon."}],
            }
        )
        await conn.response.create()
        first = await until(conn, "response.output_audio.delta", "response.done")
        assert first[-1].type == "response.output_audio.delta"
        answer_id = first[-1].response_id
        events = await speak_and_read(conn, speech(LONG_QUESTION) + silence(1200), COMPLETED)
        kinds = [e.type for e in events]
        done = next(e for e in events if e.type == "response.done")
        assert done.response.id == answer_id and done.response.status == "cancelled"
        assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.done")
        after = events[events.index(done) :]
        assert not [e for e in after if getattr(e, "response_id", None) == answer_id]
        transcript = check_live_transcript(events)
        assert {"capital", "france"} <= words(transcript), transcript


def test_the_engine_threads_run_below_the_event_loop(process: GatewayProcess) -> None:
    """gateway/server/priority.py in the CLI: the main thread (the event loop) keeps its
    priority, the engine's threads (lanes, BLAS, MLX) run `engine_nice` (10) below, and
    the main lane (its thread and its MLX thread) `MAIN_LANE_YIELDS` below those."""
    tasks = Path(f"/proc/{process.proc.pid}/task")
    nice = {int(t.name): os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in tasks.iterdir()}
    loop = nice.pop(process.proc.pid)
    assert len(nice) >= 4  # the engine's lanes at least
    engine = min(loop + 10, 19)
    main_lane = min(engine + MAIN_LANE_YIELDS, 19)
    assert all(value in (engine, main_lane) for value in nice.values()), (loop, nice)
    assert sum(value == main_lane for value in nice.values()) >= 1, (loop, nice)
    assert sum(value == engine for value in nice.values()) >= 3, (loop, nice)
