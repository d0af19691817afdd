"""The orchestrator through the duplex stage port, with fake stages in a real EngineCore.

The fakes are scripted and fast, so these tests pin the pipeline's contract: output
order and ids, streaming TTS while the LLM decodes, per-turn overrides, errors, and
barge-in at each stage leaving no output and no request behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from duplex.contracts import (
    DuplexFence,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    duplex_ephemeral_stage_request_id,
)
from duplex.outputs import fence_from_request_id
from duplex.turn import Stage
from engine.config import RemoteLlmConfig, parse_config
from engine.llm.remote_llm import RemoteLlm
from engine.llm.stage import LlmInput
from engine.pipeline.orchestrator import AsrParams, TtsParams
from engine.runtime.request import RequestOutput, SamplingParams
from engine.runtime.stage import StageOutput
from engine.stages.tts import TtsRequest
from tests.fake_engine import VOICE_RATE, Harness, audio, turn


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness(parse_config({}))
    yield harness
    harness.core.shutdown()


# ---- the pipeline -------------------------------------------------------------------


async def test_voice_turn_streams_transcript_text_and_audio(h: Harness) -> None:
    asr, llm, tts = await h.voice_turn(n=7)
    await h.until(lambda: h.finished(tts))
    kinds = [(o.stage_id, o.kind) for o in h.outputs]
    assert kinds[:2] == [(0, "transcript"), (0, "done")]
    assert h.of(asr)[0].text == "question 7"
    text = "".join(o.text for o in h.of(llm) if o.kind == "text")
    assert text.startswith("Reply to question 7. It is a fine day.")
    llm_done = h.of(llm)[-1]
    assert llm_done.kind == "done" and llm_done.finished
    assert llm_done.metadata["usage"]["completion_tokens"] == 96
    assert llm_done.metadata["finish_reason"] == "length"
    audio_out = [o for o in h.of(tts) if o.kind == "audio"]
    assert [o.kind for o in h.of(tts)][-1] == "done"
    # Every audio chunk carries the text it speaks; together they speak the reply.
    assert " ".join(o.text for o in audio_out) == text
    assert all(o.sample_rate == VOICE_RATE and o.audio for o in audio_out)
    # Speech started while the LLM was still decoding.
    assert h.outputs.index(audio_out[0]) < h.outputs.index(llm_done)
    assert audio_out[0].metadata["first_audio_ms"] > 0
    assert {"tts_first_chunk_ms", "llm_first_clause_ms"} <= set(audio_out[0].metadata)
    # Audio crosses as float32 samples, whole, and every output names its session.
    assert all(len(o.audio) % 4 == 0 for o in audio_out)
    assert {o.session_id for o in h.outputs} == {"s1"}
    # Each output names its own stage request, so its fence.
    for out in h.outputs:
        fence = fence_from_request_id(out.request_id)
        assert fence == DuplexFence("s1", 0, 0)
        assert out.request_id == (asr, llm, tts)[out.stage_id]
    assert sum(o.finished for o in h.outputs) == 3
    await h.idle()


async def test_text_turn_with_text_reply_skips_asr_and_tts(h: Harness) -> None:
    contexts = h.reserve(entry=1, final=1)
    await h.submit(contexts, turn(Stage.LLM, text="hello there", messages=[]))
    rid = contexts[0].request_id
    await h.until(lambda: h.finished(rid))
    assert {o.stage_id for o in h.outputs} == {1}
    assert "".join(o.text for o in h.outputs).startswith("Reply to hello there.")
    assert not h.tts.requests
    await h.idle()


async def test_text_turn_with_spoken_reply(h: Harness) -> None:
    contexts = h.reserve(entry=1, final=2)
    await h.submit(contexts, turn(Stage.TTS, text="hi", messages=[]))
    await h.until(lambda: h.finished(contexts[1].request_id))
    assert [o.kind for o in h.of(contexts[1].request_id)][-1] == "done"
    assert any(o.kind == "audio" for o in h.outputs)


@pytest.mark.parametrize(
    ("entry", "final", "turn_request"),
    [
        (0, 1, turn(Stage.LLM, text="typed")),  # text does not enter at ASR
        (1, 1, turn(Stage.TTS, text="typed")),  # a spoken reply needs the TTS request
        (0, 2, turn(Stage.ASR, audio=audio(1))),  # a transcription ends at ASR
    ],
)
async def test_stages_that_do_not_match_the_turn_are_refused(
    h: Harness, entry: int, final: int, turn_request: Any
) -> None:
    contexts = h.reserve(entry=entry, final=final)
    with pytest.raises(ValueError, match="were reserved for a turn that runs"):
        await h.submit(contexts, turn_request)
    assert h.orch.running_turns() == 0


async def test_a_prompt_without_a_turn_request_is_refused(h: Harness) -> None:
    contexts = h.reserve(entry=1, final=1)
    submission = DuplexStageSubmission(
        context=contexts[0], prompt={"text": "hi"}, already_submitted=False, resumable=False
    )
    with pytest.raises(ValueError, match="one TurnRequest under 'turn'"):
        await h.orch.submit(submission)


async def test_a_transcription_turn_ends_at_asr(h: Harness) -> None:
    contexts = h.reserve(entry=0, final=0)
    await h.submit(contexts, turn(Stage.ASR, audio=audio(4)))
    rid = contexts[0].request_id
    await h.until(lambda: h.finished(rid))
    await h.idle()
    assert [(o.kind, o.text) for o in h.outputs] == [("transcript", "question 4"), ("done", "")]
    assert not h.llm.inputs


async def test_history_system_prompt_and_overrides_reach_the_stages(h: Harness) -> None:
    contexts = h.reserve()
    history = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    await h.submit(
        contexts,
        turn(
            Stage.TTS,
            audio=audio(3),
            messages=history,
            max_output_tokens=12,
            voice="joe",
            speed=1.5,
            cache_key="conv-1",
            temperature=0.9,
            retention_ratio=0.5,
            post_instructions_tokens=300,
            parallel_tool_calls=False,
        ),
    )
    llm_rid, tts_rid = contexts[1].request_id, contexts[2].request_id
    await h.until(lambda: h.finished(tts_rid))
    inputs = h.llm.inputs[llm_rid]
    assert inputs.messages == [*history, {"role": "user", "content": "question 3"}]
    assert inputs.sampling_params.max_tokens == 12
    assert inputs.sampling_params.temperature == 0.9
    assert (inputs.retention_ratio, inputs.post_instructions_tokens) == (0.5, 300)
    assert inputs.parallel_tool_calls is False
    assert inputs.cache_key == "conv-1"
    assert h.tts.requests[tts_rid] == TtsRequest(speed=1.5, voice="joe")


async def test_a_turn_without_new_input_continues_from_the_history(h: Harness) -> None:
    contexts = h.reserve(entry=1, final=1)
    history = [{"role": "user", "content": "earlier question"}]
    await h.submit(contexts, turn(Stage.LLM, messages=history))
    rid = contexts[0].request_id
    await h.until(lambda: h.finished(rid))
    messages = h.llm.inputs[rid].messages
    assert messages is not None and messages[1:] == history
    assert "".join(o.text for o in h.of(rid)).startswith("Reply to earlier question.")


async def test_config_system_prompt_is_added_when_history_has_none(h: Harness) -> None:
    contexts = h.reserve(entry=1, final=1)
    await h.submit(contexts, turn(Stage.LLM, text="hey", messages=[]))
    await h.until(lambda: h.finished(contexts[0].request_id))
    messages = h.llm.inputs[contexts[0].request_id].messages
    assert messages is not None
    assert messages[0] == {"role": "system", "content": h.orch.config.system_prompt}


async def test_sampling_defaults_come_from_the_config() -> None:
    config = parse_config(
        {
            "stages": {
                "llm": {"sampling": {"temperature": 0.2, "top_k": 5, "stop": ["\n"]}},
                "tts": {"speed": 1.25, "noise_w": 0.5},
                "asr": {"max_audio_s": 9},
            }
        }
    )
    harness = Harness(config)
    try:
        asr, llm, tts = harness.orch.sampling_defaults()
        assert asr == AsrParams(max_audio_s=9.0)
        assert llm == SamplingParams(
            max_tokens=96, temperature=0.2, top_p=0.9, top_k=5, stop=["\n"]
        )
        assert tts == TtsParams("joe", 1.25, None, 0.5)
    finally:
        harness.core.shutdown()


async def test_sampling_params_refresh_only_on_a_new_config_generation(h: Harness) -> None:
    asr, llm, tts = h.orch.sampling_defaults()
    short = (asr, SamplingParams(max_tokens=3), tts)
    longer = (asr, SamplingParams(max_tokens=5), tts)
    h.reserve(entry=1, final=1, turn=0, generation=1, params=short)
    ctx = h.reserve(entry=1, final=1, turn=1, generation=1, params=longer)
    await h.submit(ctx, turn(Stage.LLM, text="a"))
    await h.until(lambda: h.finished(ctx[0].request_id))
    assert h.llm.inputs[ctx[0].request_id].sampling_params.max_tokens == 3
    ctx = h.reserve(entry=1, final=1, turn=2, generation=2, params=longer)
    await h.submit(ctx, turn(Stage.LLM, text="b"))
    await h.until(lambda: h.finished(ctx[0].request_id))
    assert h.llm.inputs[ctx[0].request_id].sampling_params.max_tokens == 5


async def test_empty_transcript_ends_the_turn_without_the_llm(h: Harness) -> None:
    original = h.asr.step

    def silent() -> list[StageOutput]:
        return [StageOutput(o.request_id, "  ", finished=True) for o in original()]

    h.asr.step = silent  # type: ignore[method-assign]
    asr, llm, tts = await h.voice_turn()
    await h.until(lambda: h.finished(tts))
    assert h.of(asr)[0].text == ""
    assert h.of(llm)[0].metadata["skipped"] is True
    assert not h.llm.inputs


async def test_asr_error_fails_the_turn_on_stage_0(h: Harness) -> None:
    h.asr.fail = True
    asr, llm, tts = await h.voice_turn()
    await h.until(lambda: h.finished(asr))
    await h.idle()
    assert [(o.kind, o.finished) for o in h.outputs] == [("error", True)]
    assert h.outputs[0].metadata["error"] == "asr exploded"


async def test_llm_rejection_fails_the_turn_on_stage_1(h: Harness) -> None:
    contexts = h.reserve(entry=1, final=2)
    await h.submit(contexts, turn(Stage.TTS, text="x", max_output_tokens=1))
    h.llm.add = _raise  # type: ignore[method-assign]
    contexts = h.reserve(entry=1, final=2, turn=1)
    await h.submit(contexts, turn(Stage.TTS, text="y"))
    rid = contexts[0].request_id
    await h.until(lambda: h.finished(rid))
    await h.idle()
    (out,) = h.of(rid)
    assert out.kind == "error" and "ValueError: no room" in str(out.metadata["error"])
    assert h.of(contexts[1].request_id) == []


def _raise(request_id: str, inputs: Any) -> None:
    raise ValueError("no room")


async def test_a_voice_the_engine_does_not_have_is_refused(h: Harness) -> None:
    contexts = h.reserve(entry=1, final=2)
    with pytest.raises(ValueError, match="unknown voice 'alloy'"):
        await h.submit(contexts, turn(Stage.TTS, text="a", voice="alloy"))
    assert h.orch.running_turns() == 0


async def test_a_session_voice_other_than_the_loaded_one_is_rejected(h: Harness) -> None:
    asr, llm, tts = h.orch.sampling_defaults()
    other = (asr, llm, dataclasses.replace(tts, voice="amy"))
    contexts = h.reserve(entry=1, final=2, params=other)
    with pytest.raises(ValueError, match="unknown voice 'amy'"):
        await h.submit(contexts, turn(Stage.TTS, text="a"))
    contexts = h.reserve(entry=1, final=1, turn=1, params=other, generation=1)
    await h.submit(contexts, turn(Stage.LLM, text="a"))  # no speech: no voice


async def test_audio_over_the_limit_is_rejected() -> None:
    harness = Harness(parse_config({"stages": {"asr": {"max_audio_s": 0.05}}}))
    try:
        with pytest.raises(ValueError, match="limit is 0.05 s"):
            await harness.voice_turn()
    finally:
        harness.core.shutdown()


async def test_submit_needs_a_reserved_fresh_turn_request(h: Harness) -> None:
    fence = DuplexFence("s1", 0, 0)
    ctx = DuplexStageRequestContext(
        request_id=duplex_ephemeral_stage_request_id(fence, stage_id=1),
        session_id="s1",
        fence=fence,
        stage_id=1,
        final_stage_id=1,
        config_generation=0,
        sampling_params=h.orch.sampling_defaults(),
    )
    with pytest.raises(ValueError, match="not reserved"):
        await h.submit([ctx], turn(Stage.LLM, text="a"))
    contexts = h.reserve(entry=1, final=1)
    await h.submit(contexts, turn(Stage.LLM, text="a"))
    with pytest.raises(ValueError, match="already submitted"):
        await h.submit(contexts, turn(Stage.LLM, text="a"))
    with pytest.raises(ValueError, match="sampling_params"):
        h.reserve(turn=5, params=(1, 2, 3))


# ---- barge-in -----------------------------------------------------------------------


async def _abort_and_check_silence(h: Harness, ids: list[str]) -> None:
    await h.orch.abort_requests(ids)
    count = len(h.outputs)
    await h.idle()  # a drained engine and no running turn: nothing more can come
    assert len(h.outputs) == count, "an aborted turn produced output after abort_requests"
    assert h.engine.pending() == {"asr": 0, "llm": 0, "tts": 0}
    await h.orch.cleanup(ids)
    assert h.orch.reserved_requests() == 0


async def _next_turn_works(h: Harness) -> None:
    ids = await h.voice_turn(n=9, turn=1, epoch=1)
    await h.until(lambda: h.finished(ids[2]))
    assert h.of(ids[0])[0].text == "question 9"
    await h.idle()


async def test_barge_in_during_asr(h: Harness) -> None:
    h.asr.hold = True
    ids = await h.voice_turn()
    await h.until(lambda: bool(h.asr.waiting))
    await _abort_and_check_silence(h, ids)
    assert h.outputs == []
    h.asr.hold = False
    await _next_turn_works(h)


async def test_barge_in_mid_llm(h: Harness) -> None:
    h.llm.step_s = 0.01
    ids = await h.voice_turn()
    await h.until(lambda: sum(o.kind == "text" for o in h.of(ids[1])) >= 3)
    await _abort_and_check_silence(h, ids)
    assert not h.finished(ids[1])
    h.llm.step_s = 0.002
    await _next_turn_works(h)


async def test_barge_in_mid_tts(h: Harness) -> None:
    h.tts.step_s = 0.02
    ids = await h.voice_turn()
    await h.until(lambda: any(o.kind == "audio" for o in h.of(ids[2])))
    await _abort_and_check_silence(h, ids)
    assert not h.finished(ids[2])
    h.tts.step_s = 0.002
    await _next_turn_works(h)


async def test_cleanup_with_abort_stops_a_running_turn(h: Harness) -> None:
    h.llm.step_s = 0.01
    ids = await h.voice_turn()
    await h.until(lambda: any(o.kind == "text" for o in h.outputs))
    await h.orch.cleanup(ids, abort=True)
    count = len(h.outputs)
    await h.idle()
    assert len(h.outputs) == count
    assert h.orch.reserved_requests() == 0


async def test_two_sessions_interleaved_get_only_their_own_outputs(h: Harness) -> None:
    h.llm.step_s = 0.004
    a = await h.voice_turn("alice", n=1)
    b = await h.voice_turn("bob", n=2)
    await h.until(lambda: h.finished(a[2]) and h.finished(b[2]))
    for ids, n, session in ((a, 1, "alice"), (b, 2, "bob")):
        text = "".join(o.text for o in h.of(ids[1]) if o.kind == "text")
        assert text.startswith(f"Reply to question {n}.")
        spoken = " ".join(o.text for o in h.of(ids[2]) if o.kind == "audio")
        assert spoken == text
        assert all(fence_from_request_id(rid).session_id == session for rid in ids)
    assert {o.request_id for o in h.outputs} == set(a) | set(b)
    # Their LLM outputs really interleaved: both were decoding in the same steps.
    order = [o.request_id for o in h.outputs if o.kind == "text"]
    assert order.index(b[1]) < max(i for i, r in enumerate(order) if r == a[1])
    # Barge-in on one session leaves the other running.
    a2 = await h.voice_turn("alice", n=3, turn=1)
    b2 = await h.voice_turn("bob", n=4, turn=1)
    await h.until(lambda: any(o.kind == "text" for o in h.of(a2[1])))
    await h.orch.abort_requests(a2)
    await h.until(lambda: h.finished(b2[2]))
    assert not h.finished(a2[2])
    await h.idle()


class _StubbornLlm:
    """An LLM backend whose stream ignores the turn's cancellation and yields one more
    delta, as a remote client flushing a buffered chunk might."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.late_delta_sent = asyncio.Event()

    async def stream(self, request_id: str, inputs: LlmInput) -> AsyncIterator[StageOutput]:
        first = RequestOutput(request_id, new_text="Hello", output_text="Hello")
        yield StageOutput(request_id, first)
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            late = RequestOutput(request_id, new_text=" again", output_text="Hello again")
            self.late_delta_sent.set()
            yield StageOutput(request_id, late)

    def abort(self, request_id: str) -> None:
        """Ignored: like a remote server, it stops only when its stream is cancelled."""


async def test_the_open_id_guard_drops_what_a_stopped_turn_still_produces() -> None:
    llm = _StubbornLlm()
    harness = Harness(parse_config({}), llm=llm)
    try:
        contexts = harness.reserve(entry=1, final=1)
        await harness.submit(contexts, turn(Stage.LLM, text="hi"))
        await asyncio.wait_for(llm.started.wait(), 10)
        await harness.orch.abort_requests([contexts[0].request_id])
        assert llm.late_delta_sent.is_set()  # the turn's task produced it after the abort
        assert [o.text for o in harness.outputs] == ["Hello"]
        assert harness.orch.running_turns() == 0
    finally:
        harness.core.shutdown()


# ---- the remote LLM backend behind the port -----------------------------------------


async def test_remote_llm_backend_behind_the_port() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        chunks = [
            {"choices": [{"delta": {"content": "Paris is the capital."}, "finish_reason": None}]},
            {"choices": [{"delta": {"content": " Yes."}, "finish_reason": "stop"}]},
        ]
        body = "".join(f"data: {__import__('json').dumps(c)}\n\n" for c in chunks)
        return httpx.Response(200, content=(body + "data: [DONE]\n\n").encode())

    remote = RemoteLlm(
        RemoteLlmConfig(base_url="http://remote.test/v1", model="m"),
        transport=httpx.MockTransport(handler),
    )
    harness = Harness(parse_config({}), llm=remote)
    try:
        ids = await harness.voice_turn()
        await harness.until(lambda: harness.finished(ids[2]))
        text = "".join(o.text for o in harness.of(ids[1]) if o.kind == "text")
        assert text == "Paris is the capital. Yes."
        spoken = [o.text for o in harness.of(ids[2]) if o.kind == "audio"]
        assert spoken == ["Paris is the capital.", "Yes."]
        assert not harness.llm.inputs  # the engine's LLM stage was not used
        await remote.aclose()
    finally:
        harness.core.shutdown()


async def test_an_unexpected_stage_failure_fails_the_turn_instead_of_hanging_it(
    h: Harness,
) -> None:
    def broken_feed(request_id: str, text: str, final: bool = False) -> bool:
        raise RuntimeError("feed broke")

    h.tts.feed = broken_feed  # type: ignore[method-assign]
    ids = await h.voice_turn()
    await h.until(lambda: h.orch.running_turns() == 0)
    errors = [o for o in h.outputs if o.kind == "error"]
    assert len(errors) == 1 and errors[0].finished
    assert "RuntimeError: feed broke" in str(errors[0].metadata["error"])
    assert errors[0].request_id in ids
    await h.idle()
