"""End to end through the duplex stage port with the real embedded models.

A spoken question (recorded with the engine's own voice) goes in; the transcript, the
streamed reply text and the reply audio come out; the audio, transcribed back by the
engine's own Whisper, must say what the text says. Barge-in at
each stage must leave no output and no request behind, and sessions must not mix.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import soxr

from duplex.contracts import (
    DuplexFence,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    duplex_ephemeral_stage_request_id,
)
from duplex.outputs import DuplexStageOutput
from duplex.turn import AUDIO_RATE, Stage, TurnRequest
from engine.build import EngineBundle, build_engine
from engine.config import load_config
from engine.runtime import clients
from engine.stages.tts import TtsRequest
from tests.helpers import wait_until

pytestmark = [pytest.mark.models, pytest.mark.asyncio(loop_scope="module")]

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"
WAIT_S = 240.0
VOICE_RATE = 22050  # the embedded Piper voice's own rate


async def record(bundle: EngineBundle, text: str, rid: str) -> bytes:
    """16 kHz float32 speech of `text` (turn audio), spoken by the engine's own voice on
    its thread."""
    stream = bundle.engine.stream("tts", rid, TtsRequest())
    await clients.tts(bundle.engine).run(lambda tts: tts.feed(rid, text, True))
    chunks = [out.payload async for out in stream]
    voice = np.concatenate([c.samples for c in chunks])
    return soxr.resample(voice, chunks[0].sample_rate, AUDIO_RATE).astype("<f4").tobytes()


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def word_errors(reference: str, hypothesis: str) -> int:
    """Word-level edit distance after normalisation (case, punctuation)."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


async def test_word_errors_counts_edits() -> None:
    assert word_errors("The capital, of France.", "the capital of france") == 0
    assert word_errors("France is Paris", "Francis Paris") == 2
    assert word_errors("a b c", "a x c d") == 2


class Client:
    """Plays the session core's part: reserves ids, submits turns, collects outputs."""

    def __init__(self, bundle: EngineBundle) -> None:
        self.bundle = bundle
        self.orch = bundle.orchestrator
        self.outputs: list[DuplexStageOutput] = []
        self.orch.attach_output_sink(self.outputs.append)
        defaults = self.orch.sampling_defaults()
        # Greedy decoding keeps the tiny model's answers on topic and repeatable.
        self.params = (defaults[0], dataclasses.replace(defaults[1], temperature=0.0), defaults[2])

    async def turn(
        self,
        session: str,
        turn: int,
        *,
        audio: bytes | None = None,
        text: str | None = None,
        speak: bool = True,
        epoch: int = 0,
        max_output_tokens: int = 32,
    ) -> list[str]:
        fence = DuplexFence(session, epoch, turn)
        entry, final = (0 if audio is not None else 1), (2 if speak else 1)
        contexts = [
            DuplexStageRequestContext(
                request_id=duplex_ephemeral_stage_request_id(fence, stage_id=n),
                session_id=session,
                fence=fence,
                stage_id=n,
                final_stage_id=final,
                config_generation=0,
                sampling_params=self.params,
            )
            for n in range(entry, final + 1)
        ]
        for ctx in contexts:
            self.orch.ensure_request(ctx)
        request = TurnRequest(
            final=Stage.TTS if speak else Stage.LLM,
            audio=audio,
            text=None if audio is not None else text,
            max_output_tokens=max_output_tokens,
            cache_key=session,
        )
        await self.orch.submit(
            DuplexStageSubmission(
                contexts[0], request.plan().prompt, already_submitted=False, resumable=False
            )
        )
        return [c.request_id for c in contexts]

    def of(self, rid: str, kind: str | None = None) -> list[DuplexStageOutput]:
        return [o for o in self.outputs if o.request_id == rid and kind in (None, o.kind)]

    def finished(self, rid: str) -> bool:
        return any(o.finished for o in self.of(rid))

    def text(self, rid: str) -> str:
        return "".join(o.text for o in self.of(rid, "text"))

    async def until(self, predicate: Callable[[], bool]) -> None:
        await wait_until(predicate, WAIT_S, "the pipeline")

    async def idle(self) -> None:
        await self.until(lambda: sum(self.bundle.engine.pending().values()) == 0)
        await self.until(lambda: self.orch.running_turns() == 0)

    async def transcribe(self, audio16k: np.ndarray, rid: str) -> str:
        """The engine's own Whisper, run on the engine thread like any ASR request."""
        async for out in self.bundle.engine.stream("asr", rid, audio16k):
            assert out.error is None
            if out.finished:
                return str(out.payload)
        raise AssertionError("ASR stream ended without a transcript")

    async def abort_and_check(self, ids: list[str]) -> None:
        await self.orch.abort_requests(ids)
        count = len(self.outputs)
        # Drained: no stage holds a request and no turn runs, so nothing is left to output.
        await self.idle()
        assert len(self.outputs) == count, "output of an aborted turn after abort_requests"
        assert self.bundle.engine.pending() == {"asr": 0, "llm": 0, "tts": 0, "vad": 0, "turn": 0}
        await self.orch.cleanup(ids)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def bundle() -> AsyncIterator[EngineBundle]:
    engine = await build_engine(load_config(ROOT / "configs" / "default.yaml"), progress=False)
    yield engine
    await engine.aclose()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def question(bundle: EngineBundle) -> bytes:
    return await record(bundle, QUESTION, "record-question")


@pytest.fixture
def client(bundle: EngineBundle) -> Client:
    return Client(bundle)


async def test_spoken_question_gets_a_spoken_answer_that_matches_its_text(
    client: Client, question: bytes
) -> None:
    asr, llm, tts = await client.turn("e2e", 0, audio=question)
    await client.until(lambda: client.finished(tts))
    assert words(client.of(asr, "transcript")[0].text) == words(QUESTION)
    assert "paris" in words(client.text(llm))
    done = client.of(llm, "done")[0]
    assert done.metadata["usage"]["completion_tokens"] > 0
    audio = client.of(tts, "audio")
    assert audio and all(o.sample_rate == VOICE_RATE for o in audio)
    assert audio[0].metadata["first_audio_ms"] > 0
    # Two more replies (typed questions, spoken answers) so that one misheard word of a
    # six-word answer does not decide the word error rate on its own.
    replies = [(llm, tts)]
    for turn, typed in enumerate(("What is the capital of Italy?", "Why is the sky blue?"), 1):
        llm_rid, tts_rid = await client.turn("e2e", turn, text=typed, max_output_tokens=40)
        await client.until(lambda rid=tts_rid: client.finished(rid))
        replies.append((llm_rid, tts_rid))
    errors = total = 0
    for n, (llm_rid, tts_rid) in enumerate(replies):
        text, chunks = client.text(llm_rid), client.of(tts_rid, "audio")
        # The chunks' texts are the reply, in order.
        assert words(" ".join(o.text for o in chunks)) == words(text)
        voice = np.frombuffer(b"".join(o.audio for o in chunks), "<f4")
        audio16k = soxr.resample(voice, VOICE_RATE, AUDIO_RATE).astype(np.float32)
        heard = await client.transcribe(audio16k, f"check-{n}")
        errors, total = errors + word_errors(text, heard), total + len(words(text))
        print(f"said {text!r}, heard {heard!r}")
    assert errors / total <= 0.2
    await client.idle()


async def test_barge_in_during_asr(client: Client, question: bytes) -> None:
    ids = await client.turn("asr-cut", 0, audio=question)
    await client.abort_and_check(ids)
    assert client.outputs == []
    await _next_turn_works(client, "asr-cut", question)


async def test_barge_in_mid_llm(client: Client, question: bytes) -> None:
    ids = await client.turn("llm-cut", 0, audio=question, max_output_tokens=64)
    await client.until(lambda: bool(client.of(ids[1], "text")))
    await client.abort_and_check(ids)
    assert not client.finished(ids[1]) and not client.of(ids[2])
    await _next_turn_works(client, "llm-cut", question)


async def test_barge_in_mid_tts(client: Client, question: bytes) -> None:
    # A question with a long answer, so the first clause's audio leaves more to speak.
    ids = await client.turn("tts-cut", 0, text="Why is the sky blue?", max_output_tokens=64)
    await client.until(lambda: bool(client.of(ids[1], "audio")))
    await client.abort_and_check(ids)
    assert not client.finished(ids[1])
    await _next_turn_works(client, "tts-cut", question)


async def _next_turn_works(client: Client, session: str, question: bytes) -> None:
    asr, llm, tts = await client.turn(session, 1, epoch=1, audio=question, max_output_tokens=24)
    await client.until(lambda: client.finished(tts))
    assert words(client.of(asr, "transcript")[0].text) == words(QUESTION)
    assert client.text(llm) and client.of(tts, "audio")
    await client.idle()


async def test_two_sessions_interleaved_each_get_their_own_outputs(client: Client) -> None:
    a = await client.turn("alice", 0, text="What is the capital of France?")
    b = await client.turn("bob", 0, text="What is the capital of Italy?")
    await client.until(lambda: client.finished(a[1]) and client.finished(b[1]))
    await client.until(lambda: client.finished(a[0]) and client.finished(b[0]))
    assert {o.request_id for o in client.outputs} == set(a) | set(b)
    assert "paris" in words(client.text(a[0]))
    assert "rome" in words(client.text(b[0]))
    for ids in (a, b):
        spoken = " ".join(o.text for o in client.of(ids[1], "audio"))
        assert words(spoken) == words(client.text(ids[0]))
    # Both replies were decoding at the same time (continuous batching across sessions).
    order = [o.request_id for o in client.outputs if o.kind == "text"]
    assert order.index(b[0]) < len(order) - 1 - order[::-1].index(a[0])
    await client.idle()
