"""Scripted fake stages (ASR, LLM, TTS) and a harness that runs the real orchestrator
over them in a real `EngineCore`. They are fast and deterministic, so tests of the
pipeline's contract need no model weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from duplex.contracts import (
    DuplexFence,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    duplex_ephemeral_stage_request_id,
)
from duplex.outputs import DuplexStageOutput
from engine.config import EngineConfig
from engine.core import AsyncEngine, EngineCore
from engine.llm import LlmInput
from engine.orchestrator import DuplexOrchestrator
from engine.request import RequestOutput
from engine.stage import StageOutput
from engine.tts import AudioChunk, TtsRequest
from tests.helpers import wait_until

WAIT_S = 10.0


class FakeAsr:
    """Transcribes audio whose first sample is n as "question n"."""

    name = "asr"

    def __init__(self) -> None:
        self.waiting: dict[str, np.ndarray] = {}
        self.hold = False
        self.fail = False

    def add(self, request_id: str, inputs: np.ndarray) -> None:
        self.waiting[request_id] = inputs

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[StageOutput]:
        time.sleep(0.002)  # stands in for model compute on the engine thread
        if self.hold:
            return []
        outs = []
        for rid, audio in list(self.waiting.items()):
            del self.waiting[rid]
            if self.fail:
                outs.append(StageOutput(rid, "", finished=True, error="asr exploded"))
            else:
                outs.append(StageOutput(rid, f" question {int(audio[0])} ", finished=True))
        return outs


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
        for rid, (req, pending, fin) in list(self.streams.items()):
            if not pending and not fin[0]:
                continue
            text = pending.pop(0) if pending else ""
            pcm = b"\x01\x00" * (10 * len(text))
            chunk = AudioChunk(pcm, req.sample_rate, text, 1000 * len(pcm) / 2 / req.sample_rate)
            finished = fin[0] and not pending
            if finished:
                del self.streams[rid]
            outs.append(StageOutput(rid, chunk, finished=finished))
        return outs


class Harness:
    """The real orchestrator over the fake stages in a real `EngineCore`, collecting every
    output its sink receives. Call `core.shutdown()` when done."""

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

    async def submit(self, contexts: list[DuplexStageRequestContext], **prompt: Any) -> None:
        submission = DuplexStageSubmission(
            context=contexts[0], prompt=prompt, already_submitted=False, resumable=False
        )
        result = await self.orch.submit(submission)
        assert (result.request_id, result.stage_id) == (
            contexts[0].request_id,
            contexts[0].stage_id,
        )

    async def voice_turn(self, session: str = "s1", n: int = 1, **kw: Any) -> list[str]:
        contexts = self.reserve(session, **kw)
        await self.submit(
            contexts, audio=question_audio(n), messages=[], output_modalities=["audio"]
        )
        return [c.request_id for c in contexts]

    def of(self, rid: str) -> list[DuplexStageOutput]:
        return [o for o in self.outputs if o.request_id == rid]

    def finished(self, rid: str) -> bool:
        return any(o.finished for o in self.of(rid))

    async def until(self, predicate: Callable[[], bool]) -> None:
        await wait_until(predicate, WAIT_S, "the fake pipeline")

    async def idle(self) -> None:
        """Return once the engine is drained and no turn runs: nothing more can output."""
        await self.until(lambda: sum(self.engine.pending().values()) == 0)
        await self.until(lambda: self.orch.running_turns() == 0)


def question_audio(n: int) -> np.ndarray:
    """100 ms of 16 kHz audio that `FakeAsr` hears as "question n"."""
    return np.full(1600, float(n), np.float32)
