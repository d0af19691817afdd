"""Prepared turns: the orchestrator works ahead on a turn and a submission of an equal turn
request adopts it (engine/pipeline/orchestrator.py rule 4), with the fake stages of
tests/fake_engine.py; then once for real, through the gateway and its embedded models."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from duplex.errors import DuplexStateError
from duplex.manager import DuplexSessionManager
from duplex.outputs import DuplexPreparedTurn, DuplexStageOutput
from duplex.turn import Stage, TurnRequest
from engine.config import parse_config
from tests.fake_engine import Harness, audio, turn
from tests.fakes import FakeStagePort
from tests.helpers import pcm16, read_audio, running_gateway


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness(parse_config({}))
    yield harness
    harness.core.shutdown()


def _voice(n: int = 1, **extra: Any) -> TurnRequest:
    return turn(Stage.TTS, audio=audio(n), **extra)


def _prepare(h: Harness, request: TurnRequest, session: str = "s1", **kw: Any) -> None:
    h.orch.prepare_turn(
        DuplexPreparedTurn(
            session_id=session,
            config_generation=kw.get("generation", 0),
            sampling_params=h.orch.sampling_defaults(),
            prompt=request.plan().prompt,
            entry_stage_id=request.entry,
            final_stage_id=request.final,
        )
    )


async def _prepared_turn_ended(h: Harness, session: str = "s1") -> None:
    task = h.orch._prepared[session].turn.task
    assert task is not None
    await asyncio.wait_for(task, 10)


def _shape(outputs: list[DuplexStageOutput]) -> dict[int, list[tuple[str, str, bool]]]:
    """Each stage's outputs in order (how stages interleave depends on timing)."""
    return {
        stage: [(o.kind, o.text, o.finished) for o in outputs if o.stage_id == stage]
        for stage in range(3)
    }


async def test_an_adopted_turn_outputs_what_a_fresh_turn_would(h: Harness) -> None:
    fresh = await h.voice_turn(n=3, turn=0)
    await h.until(lambda: h.finished(fresh[2]))
    await h.idle()
    expected = _shape(h.outputs)
    h.outputs.clear()

    _prepare(h, _voice(3))
    # The prepared work runs in the engine to its end, but nothing reaches the sink.
    await _prepared_turn_ended(h)
    assert h.outputs == []
    assert h.orch.prepared_turns() == 1

    contexts = h.reserve(turn=1)
    await h.submit(contexts, _voice(3))
    ids = [c.request_id for c in contexts]
    await h.until(lambda: h.finished(ids[2]))
    await h.idle()
    assert _shape(h.outputs) == expected
    assert all(o.request_id == ids[o.stage_id] for o in h.outputs)
    assert h.orch.prepared_turns() == 0
    assert h.orch.prepare_stats == {"adopted": 1, "discarded": 0}


async def test_a_turn_that_finished_while_prepared_is_delivered_whole(h: Harness) -> None:
    params = h.orch.sampling_defaults()
    short = (params[0], params[1].__class__(max_tokens=4), params[2])
    h.orch.prepare_turn(DuplexPreparedTurn("s1", 0, short, _voice(2).plan().prompt, 0, 2))
    await _prepared_turn_ended(h)  # the whole turn ran while held
    assert h.outputs == []
    contexts = h.reserve(params=short)
    await h.submit(contexts, _voice(2))
    ids = [c.request_id for c in contexts]
    assert h.finished(ids[2])  # delivered at submit, all of it
    assert h.of(ids[0])[0].text == "question 2"
    assert "".join(o.text for o in h.of(ids[1])) == "Reply to question 2."
    assert h.orch.running_turns() == 0


@pytest.mark.parametrize(
    "change",
    [
        {"audio": audio(4)},
        {"messages": [{"role": "user", "content": "earlier"}]},
        {"max_output_tokens": 5},
        {"cache_key": "other"},
        {"speed": 1.5},
    ],
)
async def test_a_different_submission_discards_the_prepared_turn(
    h: Harness, change: dict[str, Any]
) -> None:
    quick, h.llm.step_s = h.llm.step_s, 0.01  # slow: still running when the submit comes
    _prepare(h, _voice(3))
    await h.until(lambda: bool(h.llm.live))
    contexts = h.reserve()
    await h.submit(contexts, turn(Stage.TTS, **{"audio": audio(3), **change}))
    h.llm.step_s = quick  # the prepared turn is discarded: the submission's need not be slow
    ids = [c.request_id for c in contexts]
    await h.until(lambda: h.finished(ids[2]))
    await h.idle()
    # Only the submission's own turn ran to the end and spoke.
    assert h.orch.prepare_stats == {"adopted": 0, "discarded": 1}
    asr_text = h.of(ids[0])[0].text
    assert asr_text == ("question 4" if "audio" in change else "question 3")
    assert all(o.request_id in ids for o in h.outputs)


async def test_a_new_config_generation_is_not_adopted(h: Harness) -> None:
    _prepare(h, _voice(3), generation=0)
    contexts = h.reserve(generation=1)
    await h.submit(contexts, _voice(3))
    await h.until(lambda: h.finished(contexts[2].request_id))
    await h.idle()
    assert h.orch.prepare_stats["discarded"] == 1


async def test_discard_stops_the_work_and_emits_nothing(h: Harness) -> None:
    quick, h.llm.step_s = h.llm.step_s, 0.01  # slow: still running when it is discarded
    _prepare(h, _voice(3))
    await h.until(lambda: bool(h.llm.live))
    h.orch.discard_prepared("s1")
    await h.idle()
    h.llm.step_s = quick
    assert h.engine.pending() == {"asr": 0, "llm": 0, "tts": 0}
    assert h.outputs == []
    assert h.orch.prepared_turns() == 0
    # A later, equal submission runs afresh.
    ids = await h.voice_turn(n=3)
    await h.until(lambda: h.finished(ids[2]))
    assert h.of(ids[0])[0].text == "question 3"


async def test_a_new_preparation_replaces_the_old_one(h: Harness) -> None:
    h.llm.step_s = 0.01
    _prepare(h, _voice(3))
    _prepare(h, _voice(5))
    assert h.orch.prepared_turns() == 1
    contexts = h.reserve()
    await h.submit(contexts, _voice(5))
    await h.until(lambda: h.finished(contexts[2].request_id))
    await h.idle()
    assert h.of(contexts[0].request_id)[0].text == "question 5"
    assert h.orch.prepare_stats == {"adopted": 1, "discarded": 1}


async def test_barge_in_after_adoption_stops_the_adopted_work(h: Harness) -> None:
    h.llm.step_s = 0.01
    _prepare(h, _voice(3))
    contexts = h.reserve()
    await h.submit(contexts, _voice(3))
    ids = [c.request_id for c in contexts]
    await h.until(lambda: sum(o.kind == "text" for o in h.of(ids[1])) >= 3)
    await h.orch.abort_requests(ids)
    count = len(h.outputs)
    await h.idle()  # a drained engine and no running turn: nothing more can come
    assert len(h.outputs) == count
    assert h.engine.pending() == {"asr": 0, "llm": 0, "tts": 0}


async def test_a_prepared_failure_is_reported_by_the_adopting_turn(h: Harness) -> None:
    h.asr.fail = True
    _prepare(h, _voice(3))
    await _prepared_turn_ended(h)
    assert h.outputs == []
    contexts = h.reserve()
    await h.submit(contexts, _voice(3))
    errors = [o for o in h.outputs if o.kind == "error"]
    assert [(o.request_id, o.metadata["error"]) for o in errors] == [
        (contexts[0].request_id, "asr exploded")
    ]


async def test_a_turn_submit_would_refuse_is_not_prepared(h: Harness) -> None:
    _prepare(h, _voice(3, voice="someone-else"))
    h.orch.prepare_turn(DuplexPreparedTurn("s1", 0, h.orch.sampling_defaults(), {}, 1, 1))
    assert h.orch.prepared_turns() == 0
    assert h.engine.pending() == {"asr": 0, "llm": 0, "tts": 0}


async def test_shutdown_discards_prepared_turns(h: Harness) -> None:
    h.llm.step_s = 0.01
    _prepare(h, _voice(3), session="a")
    _prepare(h, _voice(4), session="b")
    await h.orch.shutdown()
    await h.idle()
    assert h.orch.prepared_turns() == 0 and h.outputs == []


# ---- through the duplex session manager ----------------------------------------------


async def test_the_session_handle_prepares_what_start_turn_would_submit() -> None:
    port = FakeStagePort(sampling=("asr", "llm", "tts"))
    manager = DuplexSessionManager(port, max_sessions=2)
    handle = manager.open("s1")
    handle.update_config({"voice": "joe"})
    request = turn(Stage.TTS, text="hi")
    handle.prepare_turn(request)
    [prepared] = port.prepared
    assert (prepared.session_id, prepared.config_generation) == ("s1", 1)
    assert prepared.sampling_params == ("asr", "llm", "tts")
    assert TurnRequest.from_plan(prepared.prompt) == request
    assert (prepared.entry_stage_id, prepared.final_stage_id) == (1, 2)
    handle.discard_prepared()
    await handle.close()
    assert port.discarded == ["s1", "s1"]  # closing drops it too
    with pytest.raises(DuplexStateError):
        handle.prepare_turn(request)


# ---- for real: the gateway with its embedded models ----------------------------------

RECORDING = Path("/usr/share/sounds/alsa/Front_Center.wav")


def _recording_pcm24k() -> bytes:
    return pcm16(read_audio(RECORDING, 24000))


async def _stream(ws: Any, pcm: bytes) -> None:
    """Append `pcm` in 100 ms chunks at real-time pace, as a microphone would."""
    step = 24000 * 2 // 10
    for i in range(0, len(pcm), step):
        chunk = base64.b64encode(pcm[i : i + step]).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        await asyncio.sleep(0.1)


def _prepared_counts(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "duplex_gateway_prepared_responses_total"
    }


@pytest.mark.models
async def test_a_spoken_turn_is_answered_from_its_prepared_response() -> None:
    """The turn's work starts during the silence before speech_stopped; the answer the
    client gets is the prepared one, taken over when the turn is committed."""
    with running_gateway() as gw:
        url = f"ws://127.0.0.1:{gw.port}/v1/realtime?model=duplex-smollm2"
        async with connect(url, max_size=None) as ws:
            await ws.recv()  # session.created
            update = {
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {
                    "input": {
                        "transcription": {"model": "whisper-1"},
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 800},
                    }
                },
            }
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            silence = bytes(24000 * 2 // 2)
            sender = asyncio.create_task(_stream(ws, silence + _recording_pcm24k() + silence * 4))
            seen: list[str] = []
            transcript, audio_bytes = "", 0
            async with asyncio.timeout(120):
                while True:
                    event = json.loads(await ws.recv())
                    seen.append(event["type"])
                    if event["type"].endswith("input_audio_transcription.completed"):
                        transcript = event["transcript"]
                    elif event["type"] == "response.output_audio.delta":
                        audio_bytes += len(base64.b64decode(event["delta"]))
                    elif event["type"] == "error":
                        raise AssertionError(event)
                    elif event["type"] == "response.done":
                        # Finished, not cut: the 135M model's answer may run to the profile's
                        # max_tokens (96), which ends it "incomplete".
                        response = event["response"]
                        assert response["status"] in ("completed", "incomplete"), response
                        if response["status"] == "incomplete":
                            assert response["status_details"]["reason"] == "max_output_tokens"
                        break
            await sender
        counts = await asyncio.to_thread(_prepared_counts, gw.port)
    assert "front" in transcript.lower() and "center" in transcript.lower()
    assert audio_bytes > 24000  # over half a second of spoken answer
    assert seen.index("input_audio_buffer.speech_stopped") < seen.index("response.created")
    assert counts.get("adopted", 0) >= 1
