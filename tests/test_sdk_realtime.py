"""The official `openai` SDK, unmodified, against `duplex-gateway` started through its CLI
with the real embedded models (SmolLM2, Whisper tiny.en, Piper joe, Silero VAD).

A raw `websockets` client covers the frames the SDK will not send.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from websockets.asyncio.client import connect

from tests.helpers import ROOT, pcm16, read_audio, running_gateway
from tests.realtime_client import client, until

pytestmark = pytest.mark.models

RECORDING = Path("/usr/share/sounds/alsa/Front_Center.wav")
MODEL = "duplex-smollm2"
RATE = 24000


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`duplex-gateway` in a subprocess; yields its ws base URL (…/v1).

    The default profile with greedy decoding, so the facts the answers are checked for
    do not depend on a sampling draw.
    """
    profile = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    profile["stages"]["llm"]["sampling"]["temperature"] = 0.0
    path = tmp_path_factory.mktemp("profile") / "greedy.yaml"
    path.write_text(yaml.safe_dump(profile))
    with running_gateway("--config", str(path)) as gw:
        yield f"ws://127.0.0.1:{gw.port}/v1"
    assert gw.proc.returncode == 0, "SIGTERM must shut down cleanly:\n" + "".join(gw.lines[-30:])


def recording_pcm(path: Path = RECORDING) -> bytes:
    return pcm16(read_audio(path, RATE))


def silence(ms: int) -> bytes:
    return bytes(RATE * 2 * ms // 1000)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def append(conn: Any, pcm: bytes, chunk_ms: int = 100) -> None:
    step = RATE * 2 * chunk_ms // 1000
    for i in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=b64(pcm[i : i + step]))


async def settle(conn: Any, quiet_s: float = 1.0) -> list[Any]:
    """Events until none has come for `quiet_s` seconds."""
    events = []
    while True:
        try:
            events.append(await asyncio.wait_for(conn.recv(), quiet_s))
        except TimeoutError:
            return events


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


async def text_session(conn: Any) -> None:
    await conn.session.update(
        session={
            "type": "realtime",
            "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
        }
    )
    await until(conn, "session.updated")


async def ask_text(conn: Any, question: str) -> list[Any]:
    await conn.conversation.item.create(
        item={
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": question}],
        }
    )
    await conn.response.create()
    return await until(conn, "response.done")


async def test_ga_text_turn(gateway: str) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        first = await conn.recv()
        assert first.type == "session.created"
        await text_session(conn)
        events = await ask_text(conn, "What is the capital of France?")
        kinds = [e.type for e in events]
        assert kinds[:4] == [
            "conversation.item.added",
            "conversation.item.done",
            "response.created",
            "response.output_item.added",
        ]
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        done = events[-1].response
        assert done.status == "completed" and "paris" in text.lower()
        assert done.usage.output_tokens > 0 and done.usage.input_tokens > 0
        # The next turn sees the history: the model is asked about its own answer.
        events = await ask_text(conn, "Repeat the name of that city.")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert "paris" in text.lower()


async def test_beta_text_turn(gateway: str) -> None:
    async with client(gateway).beta.realtime.connect(model=MODEL) as conn:
        first = await conn.recv()
        assert first.type == "session.created" and first.session.modalities == ["audio"]
        await conn.session.update(session={"modalities": ["text"], "turn_detection": None})
        await until(conn, "session.updated")
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Say hello."}],
            }
        )
        await conn.response.create()
        events = await until(conn, "response.done")
        kinds = {e.type for e in events}
        assert "response.text.delta" in kinds and "conversation.item.created" in kinds
        assert "response.output_text.delta" not in kinds


async def transcribe_with_gateway(base: str, pcm24k: bytes) -> str:
    """ASR of assistant audio, by the same gateway: sent back as a user audio item."""
    async with client(base).realtime.connect(model=MODEL) as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["text"],
                "audio": {
                    "input": {"turn_detection": None, "transcription": {"model": "whisper-1"}}
                },
            }
        )
        await until(conn, "session.updated")
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_audio", "audio": b64(pcm24k)}],
            }
        )
        await conn.response.create(response={"max_output_tokens": 1})
        events = await until(conn, "conversation.item.input_audio_transcription.completed")
        return events[-1].transcript


async def test_voice_turn_from_a_real_recording(gateway: str) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {
                    "input": {
                        "transcription": {"model": "whisper-1"},
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 400},
                    }
                },
            }
        )
        await until(conn, "session.updated")
        await append(conn, silence(300) + recording_pcm() + silence(1000))
        events = await until(conn, "response.done", timeout=180)
        kinds = [e.type for e in events]
        for a, b in [
            ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"),
            ("input_audio_buffer.speech_stopped", "input_audio_buffer.committed"),
            ("input_audio_buffer.committed", "response.created"),
            ("response.created", "response.output_audio.delta"),
        ]:
            assert kinds.index(a) < kinds.index(b), (a, b)
        user = next(
            e for e in events if e.type == "conversation.item.input_audio_transcription.completed"
        )
        assert {"front", "center"} <= set(words(user.transcript)), user.transcript
        deltas = [
            base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
        ]
        assert max(len(d) for d in deltas) <= RATE * 2 // 10  # <= 100 ms each
        spoken = "".join(
            e.delta for e in events if e.type == "response.output_audio_transcript.delta"
        )
        assert events[-1].response.status == "completed"
    heard = await transcribe_with_gateway(gateway, b"".join(deltas))
    said, got = words(spoken), set(words(heard))
    overlap = sum(w in got for w in said) / max(len(said), 1)
    assert overlap >= 0.5, (spoken, heard)


async def start_spoken_answer(conn: Any, question: str) -> list[Any]:
    """A text question answered aloud; returns events up to the first audio delta."""
    await conn.conversation.item.create(
        item={
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": question}],
        }
    )
    await conn.response.create()
    events = await until(conn, "response.output_audio.delta", "response.done")
    assert events[-1].type != "response.done", events[-1].response.status_details
    return events


async def barge_session(conn: Any, create_response: bool = False) -> None:
    await conn.session.update(
        session={
            "type": "realtime",
            "output_modalities": ["audio"],
            "audio": {
                "input": {
                    "turn_detection": {
                        "type": "server_vad",
                        "silence_duration_ms": 300,
                        "prefix_padding_ms": 100,
                        "create_response": create_response,
                        "interrupt_response": True,
                    }
                }
            },
        }
    )
    await until(conn, "session.updated")


async def test_barge_in_mid_response_and_truncate(gateway: str) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await barge_session(conn)
        events = await start_spoken_answer(conn, "Tell me a long story about a dragon.")
        response_id = events[-1].response_id
        item_id = events[-1].item_id
        await append(conn, recording_pcm())
        events = await until(conn, "response.done")
        kinds = [e.type for e in events]
        assert "input_audio_buffer.speech_started" in kinds
        done = events[-1].response
        assert done.id == response_id and done.status == "cancelled"
        assert done.status_details.reason == "turn_detected"
        item_done = next(
            e for e in events if e.type == "conversation.item.done" and e.item.id == item_id
        )
        assert item_done.item.status == "incomplete"
        full = item_done.item.content[0].transcript
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=300)
        truncated = await until(conn, "conversation.item.truncated")
        assert truncated[-1].audio_end_ms == 300
        await conn.conversation.item.retrieve(item_id=item_id)
        retrieved = (await until(conn, "conversation.item.retrieved"))[-1].item
        heard = retrieved.content[0].transcript or ""
        assert len(heard) < len(full)
        audio = base64.b64decode(retrieved.content[0].audio)
        assert len(audio) == 300 * RATE * 2 // 1000
        # The cancel races a finished response: not active, and the session goes on.
        await conn.response.cancel(response_id=response_id)
        error = (await until(conn, "error"))[-1]
        assert error.error.code == "response_cancel_not_active"
        await conn.input_audio_buffer.clear()
        await until(conn, "input_audio_buffer.cleared")


@pytest.mark.timeout(2400)  # 50 spoken answers on a small CPU take several minutes
async def test_fifty_barge_ins_leave_no_stale_audio(gateway: str) -> None:
    """Speech over 50 answers. An answer that finished before the speech was detected is
    the documented race (nothing to cancel) and does not count towards the 50."""
    stale = barge_ins = attempts = 0
    cancelled: set[str] = set()

    def count_stale(events: list[Any]) -> int:
        return sum(
            e.type == "response.output_audio.delta" and e.response_id in cancelled for e in events
        )

    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await barge_session(conn)
        while barge_ins < 50:
            attempts += 1
            assert attempts <= 60, f"only {barge_ins} barge-ins in 60 attempts"
            # Speak as soon as the answer starts: a short answer could otherwise finish
            # (its audio all sent) before the VAD has heard the interruption.
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": f"Tell me about the number {attempts}."}
                    ],
                }
            )
            await conn.response.create()
            stale += count_stale(await until(conn, "response.created"))
            await append(conn, recording_pcm()[: RATE * 2 * 6 // 10])
            events = await until(conn, "response.done")
            stale += count_stale(events)
            if events[-1].response.status == "cancelled":
                assert events[-1].response.status_details.reason == "turn_detected"
                cancelled.add(events[-1].response.id)
                barge_ins += 1
            # Let the VAD hear the speech end (a recording may hold several utterances),
            # so no late speech_started interrupts the next answer.
            await append(conn, silence(1000))
            stale += count_stale(await settle(conn, 0.6))
            await conn.input_audio_buffer.clear()
            stale += count_stale(await until(conn, "input_audio_buffer.cleared"))
    assert stale == 0


ERROR_CASES = [
    ({"type": "no.such.event"}, "invalid_value"),
    ({"type": "input_audio_buffer.append"}, "missing_required_parameter"),
    ({"type": "input_audio_buffer.append", "audio": 7}, "invalid_value"),
    ({"type": "input_audio_buffer.append", "audio": "%%%"}, "invalid_value"),
    ({"type": "input_audio_buffer.append", "audio": "AAAA"}, "invalid_value"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
    ({"type": "response.cancel"}, "response_cancel_not_active"),
    ({"type": "conversation.item.retrieve", "item_id": "item_nope"}, "item_not_found"),
    (
        {
            "type": "conversation.item.truncate",
            "item_id": "item_nope",
            "content_index": 0,
            "audio_end_ms": 5,
        },
        "item_not_found",
    ),
    (
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "audio": {"input": {"turn_detection": {"type": "semantic_vad", "threshold": 0.5}}},
            },
        },
        "invalid_value",
    ),
    (
        {"type": "session.update", "session": {"type": "realtime", "temperature": 0.5}},
        "unknown_parameter",
    ),
]


async def test_every_error_case_through_the_sdk(gateway: str) -> None:
    async with client(gateway).realtime.connect(model=MODEL) as conn:
        await text_session(conn)
        for n, (event, code) in enumerate(ERROR_CASES):
            await conn.send({**event, "event_id": f"evt_{n}"})
            error = (await until(conn, "error", timeout=10))[-1]
            assert error.error.code == code, event
            assert error.error.event_id == f"evt_{n}"
        # A second response while one is active.
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hello"}],
            }
        )
        await conn.response.create()
        await conn.send({"type": "response.create", "event_id": "evt_second"})
        events = await until(conn, "response.done")
        errors = [e for e in events if e.type == "error"]
        assert errors[0].error.code == "conversation_already_has_active_response"
        assert errors[0].error.event_id == "evt_second"
        assert events[-1].response.status == "completed"


async def test_raw_frames_the_sdk_will_not_send(gateway: str) -> None:
    async with connect(gateway + f"/realtime?model={MODEL}", max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for frame, code in [
            ("{broken", "invalid_json"),
            (b"\x01\x02", "invalid_event"),
            ("[]", "invalid_json"),
            (
                json.dumps(
                    {
                        "type": "input_audio_buffer.append",
                        "audio": "A" * (15 * 1024 * 1024 + 500_000),
                    }
                ),
                "event_too_large",
            ),
        ]:
            await ws.send(frame)
            event = json.loads(await ws.recv())
            assert event["type"] == "error" and event["error"]["code"] == code
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        assert json.loads(await ws.recv())["type"] == "input_audio_buffer.cleared"
