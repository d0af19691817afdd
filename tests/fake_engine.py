"""Scripted, fast fake engine stages in a real `EngineCore`, and a harness that drives
the orchestrator through the duplex stage port with them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from duplex.contracts import (
    DuplexFence,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    duplex_ephemeral_stage_request_id,
)
from duplex.outputs import DuplexStageOutput
from duplex.turn import Message, Stage, TurnRequest
from engine.config import EngineConfig
from engine.llm.stage import LlmInput
from engine.pipeline.orchestrator import DuplexOrchestrator
from engine.runtime.core import AsyncEngine, EngineCore
from engine.runtime.request import RequestOutput
from engine.runtime.stage import StageOutput
from engine.stages.tts import AudioChunk, TtsRequest
from tests.helpers import wait_until

__all__ = [
    "BLOCK",
    "FakeAsr",
    "FakeAsrRequest",
    "FakeLiveTranscript",
    "FakeLlm",
    "FakeTts",
    "Harness",
    "VOICE_RATE",
    "audio",
    "spoken",
    "turn",
]

WAIT_S = 10.0
VOICE_RATE = 22050


# ---- fake stages --------------------------------------------------------------------

BLOCK = 1600  # samples of one spoken word in `spoken` audio (100 ms at 16 kHz)


def spoken(*words: int) -> np.ndarray:
    """Audio that `FakeAsr` hears as words: one 100 ms block per word n ("w{n}"), and a
    0 is a block of silence."""
    return np.repeat(np.asarray(words, np.float32), BLOCK)


@dataclass(frozen=True)
class FakeAsrRequest:
    """The fake of the ASR stage's `AsrRequest` (a `FakeLiveTranscript` builds them)."""

    audio: np.ndarray
    prefix: tuple[str, ...] = ()
    prompt: str = ""
    logprobs: bool = False
    partial: bool = False


@dataclass(frozen=True)
class FakeTranscription:
    words: tuple[str, ...]
    decoded: int  # words decoded after the forced prefix

    @property
    def text(self) -> str:
        return "".join(f" {w}" for w in self.words)


@dataclass(frozen=True)
class FakeLiveDelta:
    text: str
    tokens: tuple[tuple[str, float], ...]


def _delta(words: list[str]) -> FakeLiveDelta:
    return FakeLiveDelta("".join(f" {w}" for w in words), tuple((f" {w}", -0.25) for w in words))


class FakeLiveTranscript:
    """LocalAgreement-2 over `FakeAsr`'s words: a partial commits the words it shares
    with the previous partial; a final request forces the committed words as prefix."""

    def __init__(self, prompt: str, logprobs: bool) -> None:
        self.prompt, self.logprobs = prompt, logprobs
        self.committed: list[str] = []
        self.previous: tuple[str, ...] | None = None
        self.frozen = False
        self.events: list[str] = []
        self.counts_from_s = 0.0  # every guess counts

    def request(self, audio: np.ndarray, *, final: bool) -> FakeAsrRequest:
        if final:
            self.frozen = True
        elif self.frozen:
            raise RuntimeError("a final request was made: thaw() before more partials")
        self.events.append("final" if final else "partial")
        prefix = tuple(self.committed) if final else ()
        return FakeAsrRequest(audio, prefix, self.prompt, self.logprobs, partial=not final)

    def agree(self, result: FakeTranscription) -> FakeLiveDelta | None:
        previous, self.previous = self.previous, result.words
        if self.frozen or previous is None:
            return None
        common = 0
        while common < min(len(previous), len(result.words)):
            if previous[common] != result.words[common]:
                break
            common += 1
        new = list(result.words[len(self.committed) : common])
        if not new:
            return None
        self.committed += new
        return _delta(new)

    def finish(self, result: FakeTranscription) -> FakeLiveDelta:
        return _delta(list(result.words[len(self.committed) :]))

    def freeze(self) -> None:
        self.frozen = True
        self.events.append("freeze")

    def thaw(self) -> None:
        self.frozen = False
        self.events.append("thaw")


class FakeAsr:
    """Transcribes audio whose first sample is n as "question n"; a `FakeAsrRequest`'s
    audio as the words of `spoken` (a partial hears whole blocks only)."""

    name = "asr"

    def __init__(self) -> None:
        self.waiting: dict[str, Any] = {}
        self.hold = False
        self.fail = False
        self.lives: list[FakeLiveTranscript] = []
        self.requests: list[tuple[str, Any]] = []  # every request added, in order
        self.counts_from_s = 0.0  # the live transcripts' first audio that counts

    def new_live_transcript(self, prompt: str, logprobs: bool) -> FakeLiveTranscript:
        live = FakeLiveTranscript(prompt, logprobs)
        live.counts_from_s = self.counts_from_s
        self.lives.append(live)
        return live

    def add(self, request_id: str, inputs: Any) -> None:
        self.requests.append((request_id, inputs))
        self.waiting[request_id] = inputs

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[StageOutput]:
        time.sleep(0.002)
        if self.hold:
            return []
        outs = []
        for rid, inputs in list(self.waiting.items()):
            del self.waiting[rid]
            if self.fail:
                outs.append(StageOutput(rid, "", finished=True, error="asr exploded"))
            elif isinstance(inputs, FakeAsrRequest):
                outs.append(StageOutput(rid, _hear(inputs), finished=True))
            else:
                outs.append(StageOutput(rid, f" question {int(inputs[0])} ", finished=True))
        return outs


def _hear(request: FakeAsrRequest) -> FakeTranscription:
    blocks = len(request.audio) // BLOCK if request.partial else -(-len(request.audio) // BLOCK)
    values = [int(request.audio[i * BLOCK]) for i in range(blocks)]
    words = tuple(f"w{v}" for v in values if v)
    if words[: len(request.prefix)] != request.prefix:
        raise AssertionError(f"forced prefix {request.prefix} is not what was said: {words}")
    return FakeTranscription(words, decoded=len(words) - len(request.prefix))


class FakeLlm:
    """Replies "Reply to <user>. Then more words, ..." one word per step."""

    name = "llm"

    def __init__(self) -> None:
        self.live: dict[str, list[str]] = {}
        self.done: dict[str, int] = {}
        self.inputs: dict[str, LlmInput] = {}
        self.step_s = 0.002

    def add(self, request_id: str, inputs: LlmInput) -> None:
        if inputs.messages is None:
            raise ValueError("FakeLlm takes messages")
        user = inputs.messages[-1]["content"]
        words = f"Reply to {user}. It is a fine day. Then more words follow here.".split()
        while len(words) < inputs.sampling_params.max_tokens:
            words += ["And", "another", "sentence", "of", "the", "reply", "goes", "on."]
        self.inputs[request_id] = inputs
        self.live[request_id] = words[: inputs.sampling_params.max_tokens]
        self.done[request_id] = 0

    def abort(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.live)

    def step(self) -> list[StageOutput]:
        time.sleep(self.step_s)
        outs = []
        for rid, words in list(self.live.items()):
            n = self.done[rid] = self.done[rid] + 1
            finished = n == len(words)
            params = self.inputs[rid].sampling_params
            out = RequestOutput(
                rid,
                new_text=(" " if n > 1 else "") + words[n - 1],
                output_text=" ".join(words[:n]),
                finished=finished,
                finish_reason=("length" if n == params.max_tokens else "stop")
                if finished
                else None,
                prompt_tokens=10,
                completion_tokens=n,
            )
            outs.append(StageOutput(rid, out, finished=finished))
            if finished:
                del self.live[rid]
        return outs


class FakeTts:
    """Speaks one clause per request per step: 10 samples per character."""

    name = "tts"

    def __init__(self) -> None:
        self.streams: dict[str, tuple[TtsRequest, list[str], list[bool]]] = {}
        self.requests: dict[str, TtsRequest] = {}
        self.step_s = 0.002

    def add(self, request_id: str, inputs: TtsRequest) -> None:
        self.streams[request_id] = (inputs, [], [False])
        self.requests[request_id] = inputs

    def feed(self, request_id: str, text: str, final: bool = False) -> bool:
        if request_id not in self.streams:
            return False
        _, pending, fin = self.streams[request_id]
        if text:
            pending.append(text)
        fin[0] = final
        return True

    def abort(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def has_work(self) -> bool:
        return any(p or f[0] for _, p, f in self.streams.values())

    def step(self) -> list[StageOutput]:
        time.sleep(self.step_s)
        outs = []
        for rid, (_, pending, fin) in list(self.streams.items()):
            if not pending and not fin[0]:
                continue
            text = pending.pop(0) if pending else ""
            samples = np.full(10 * len(text), 0.5, np.float32)
            chunk = AudioChunk(samples, VOICE_RATE, text, 1000 * len(samples) / VOICE_RATE)
            finished = fin[0] and not pending
            if finished:
                del self.streams[rid]
            outs.append(StageOutput(rid, chunk, finished=finished))
        return outs


# ---- harness ------------------------------------------------------------------------


class Harness:
    def __init__(self, config: EngineConfig, llm: Any = None) -> None:
        self.asr, self.llm, self.tts = FakeAsr(), FakeLlm(), FakeTts()
        self.core = EngineCore({"asr": self.asr, "llm": self.llm, "tts": self.tts})
        self.core.start()
        self.engine = AsyncEngine(self.core)
        self.orch = DuplexOrchestrator(self.engine, config, llm=llm)
        self.outputs: list[DuplexStageOutput] = []
        self.orch.attach_output_sink(self.outputs.append)

    def reserve(
        self,
        session: str = "s1",
        *,
        turn: int = 0,
        epoch: int = 0,
        entry: int = 0,
        final: int = 2,
        generation: int = 0,
        params: tuple[Any, ...] | None = None,
    ) -> list[DuplexStageRequestContext]:
        fence = DuplexFence(session, epoch, turn)
        contexts = [
            DuplexStageRequestContext(
                request_id=duplex_ephemeral_stage_request_id(fence, stage_id=n),
                session_id=session,
                fence=fence,
                stage_id=n,
                final_stage_id=final,
                config_generation=generation,
                sampling_params=params or self.orch.sampling_defaults(),
            )
            for n in range(entry, final + 1)
        ]
        for ctx in contexts:
            self.orch.ensure_request(ctx)
        return contexts

    async def submit(self, contexts: list[DuplexStageRequestContext], request: TurnRequest) -> None:
        submission = DuplexStageSubmission(
            context=contexts[0],
            prompt=request.plan().prompt,
            already_submitted=False,
            resumable=False,
        )
        result = await self.orch.submit(submission)
        assert (result.request_id, result.stage_id) == (
            contexts[0].request_id,
            contexts[0].stage_id,
        )

    async def voice_turn(self, session: str = "s1", n: int = 1, **kw: Any) -> list[str]:
        contexts = self.reserve(session, **kw)
        await self.submit(contexts, turn(audio=audio(n)))
        return [c.request_id for c in contexts]

    def of(self, rid: str) -> list[DuplexStageOutput]:
        return [o for o in self.outputs if o.request_id == rid]

    def finished(self, rid: str) -> bool:
        return any(o.finished for o in self.of(rid))

    async def until(self, predicate: Callable[[], bool]) -> None:
        await wait_until(predicate, WAIT_S, "the harness's condition", interval=0.002)

    async def idle(self) -> None:
        await self.until(lambda: sum(self.engine.pending().values()) == 0)
        await self.until(lambda: self.orch.running_turns() == 0)


def audio(n: int) -> bytes:
    """A tenth of a second of turn audio that `FakeAsr` transcribes as "question n"."""
    return np.full(1600, float(n), "<f4").tobytes()


def turn(final: Stage = Stage.TTS, **fields: Any) -> TurnRequest:
    """A turn request; `messages` may be given as role/content dicts."""
    messages = tuple(Message(**m) for m in fields.pop("messages", ()))
    return TurnRequest(final=final, messages=messages, **fields)
