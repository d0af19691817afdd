"""The turn runner: one turn through ASR → LLM → TTS, its outputs streamed to the sink.

A turn is one asyncio task on the event loop: it streams the turn's audio through the
ASR stage, the transcript and history through the LLM, and each complete clause of the
LLM's text through the TTS stage while the LLM is still decoding. The model work runs on
the engine thread; the task only moves results between stages and hands them to the
sink. Which turns run, under which ids, is `engine.pipeline.orchestrator`'s bookkeeping; the
rules of that module hold here: only open ids output (rule 2), a failing stage ends its
turn with one error (rule 3), a prepared turn's outputs are held (rule 4), and a turn
that finishes a live utterance decodes only its tail (rule 5).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.outputs import DuplexStageOutput
from duplex.turn import Stage, TurnRequest
from engine.config import EngineConfig
from engine.listening.listener import Listener, Utterance, final_text
from engine.llm.backend import EngineLlm, LlmBackend
from engine.llm.stage import LlmInput
from engine.pipeline.chat_format import chat_messages, chat_tool_choice, chat_tools
from engine.runtime import clients
from engine.runtime.core import AsyncEngine
from engine.runtime.request import RequestOutput, SamplingParams
from engine.runtime.stage import StageOutput
from engine.runtime.stage_params import TtsParams
from engine.stages.clauses import ClauseSplitter

__all__ = ["Turn", "TurnRunner"]

logger = logging.getLogger(__name__)

ASR, LLM, TTS = Stage.ASR, Stage.LLM, Stage.TTS
# The engine stage that runs each pipeline stage.
STAGE_ENGINES = {ASR: "asr", LLM: "llm", TTS: "tts"}
# Characters of text per second of speech (the default voice at speed 1): how a speaker
# turns its unspoken text into seconds for the LLM stage's pacing (`set_runway`).
CHARS_PER_SPEECH_S = 14.0


@dataclass
class Turn:
    session_id: str
    ids: dict[int, str]  # stage id -> engine request id, entry stage .. final stage
    out_ids: dict[int, str]  # stage id -> the request id its outputs carry
    request: TurnRequest
    params: tuple[Any, ...]
    task: asyncio.Task[None] | None = None
    marks: dict[str, float] = field(default_factory=dict)
    # A prepared turn's outputs wait here until a submission adopts it (rule 4).
    held: list[tuple[int, str, dict[str, Any]]] | None = None
    held_finished: set[int] = field(default_factory=set)
    # The live utterance this turn finishes (rule 5), claimed from the session's listener.
    utterance: Utterance | None = None
    asr_metrics: dict[str, float] = field(default_factory=dict)
    transcribed: bool = False  # its transcript was emitted (held, for a prepared turn)

    def since(self, mark: str) -> float:
        return (time.perf_counter() - self.marks[mark]) * 1000.0


class TurnRunner:
    """Runs turns through the stages and streams their outputs to `sink`."""

    def __init__(
        self,
        engine: AsyncEngine,
        config: EngineConfig,
        llm: LlmBackend,
        listeners: Mapping[str, Listener],
    ) -> None:
        self.engine = engine
        self.config = config
        self.llm = llm
        self.sink: Callable[[DuplexStageOutput], None] | None = None
        # Rule 2: the request ids whose outputs may still reach the sink.
        self.open_ids: set[str] = set()
        # The port's listeners by session id: a stopped turn gives its utterance back.
        self._listeners = listeners

    def start(self, turn: Turn) -> asyncio.Task[None]:
        """Run `turn` in a task of its own."""
        turn.marks["submit"] = time.perf_counter()
        return asyncio.create_task(self._run(turn), name=f"turn {turn.ids[min(turn.ids)]}")

    def stop(self, turn: Turn) -> None:
        """Stop a turn at once: no id of it outputs again, every stage drops its request;
        a live utterance it had not transcribed yet goes back to the listener (rule 5)."""
        unfinished = turn.held is not None or not turn.transcribed
        listener = self._listeners.get(turn.session_id)
        if turn.utterance is not None and unfinished and listener is not None:
            listener.release(turn.utterance)
        turn.utterance = None
        for rid in turn.out_ids.values():
            self.open_ids.discard(rid)
        if turn.task is not None and turn.task is not asyncio.current_task():
            turn.task.cancel()
        for stage, rid in turn.ids.items():
            if stage == LLM:
                self.llm.abort(rid)
            else:
                self.engine.abort(STAGE_ENGINES[Stage(stage)], rid)

    # --- output ----------------------------------------------------------------------

    def emit(self, turn: Turn, stage: int, kind: str, **fields: Any) -> None:
        if turn.held is not None:
            if stage in turn.ids and stage not in turn.held_finished:
                if fields.get("finished"):
                    turn.held_finished.add(stage)
                turn.held.append((stage, kind, fields))
            return
        rid = turn.out_ids.get(stage)
        if rid is None or rid not in self.open_ids:
            return  # aborted, cleaned up or already finished: dropped by rule 2
        if fields.get("finished"):
            self.open_ids.discard(rid)
        if self.sink is None:
            return
        self.sink(
            DuplexStageOutput(
                session_id=turn.session_id, request_id=rid, stage_id=stage, kind=kind, **fields
            )
        )

    def fail(self, turn: Turn, stage: int, error: str, *, code: str | None = None) -> None:
        """Rule 3: one error output on `stage`, then the whole turn is stopped."""
        metadata = {"error": error} if code is None else {"error": error, "error_code": code}
        self.emit(turn, stage, "error", finished=True, metadata=metadata)
        self.stop(turn)

    # --- the pipeline ----------------------------------------------------------------

    async def _run(self, turn: Turn) -> None:
        try:
            text = turn.request.text
            if turn.request.audio is not None:
                text = await self._transcribe(turn)
                if text is None or max(turn.ids) == ASR:
                    return
            await self._respond(turn, text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or a dead engine must fail the turn, not hang it
            logger.exception("turn %s failed", turn.ids[min(turn.ids)])
            still_open = self._open_stages(turn)
            if still_open:
                self.fail(turn, still_open[0], f"{type(exc).__name__}: {exc}")

    def _open_stages(self, turn: Turn) -> list[int]:
        if turn.held is not None:
            return [s for s in sorted(turn.ids) if s not in turn.held_finished]
        return [s for s, rid in sorted(turn.out_ids.items()) if rid in self.open_ids]

    async def _transcribe(self, turn: Turn) -> str | None:
        """Stage 0 of a turn: finish the live utterance it names (rule 5), report the
        words the speech detection already heard in it (`Utterance.words`), or
        transcribe its audio whole, with a transcript of its own when it asks for a
        prompt or logprobs."""
        request = turn.request
        turn.marks["asr"] = time.perf_counter()
        audio = np.frombuffer(request.audio or b"", dtype="<f4")
        utterance = turn.utterance
        live = utterance.live if utterance is not None else None
        words = utterance.words if utterance is not None else None
        asks_more = request.transcription_prompt or request.logprobs
        if live is None and words is not None and not asks_more:
            return self._transcribed(turn, words.strip(), heard=True)
        if live is None and (request.transcription_prompt or request.logprobs):
            asr_prompt, asr_logprobs = request.transcription_prompt, request.logprobs
            live = await clients.asr(self.engine).run(
                lambda asr: asr.new_live_transcript(asr_prompt, asr_logprobs)
            )
        if live is None:
            payload = await self._asr(turn, audio)
            return None if payload is None else self._transcribed(turn, str(payload).strip())
        result = await self._asr(turn, live.request(audio, final=True))
        if result is None:
            return None
        tail = live.finish(result)
        committed = utterance.committed if utterance is not None else ""
        tokens = [*(utterance.tokens if utterance is not None else ()), *tail.tokens]
        logprobs = tuple(tokens) if request.logprobs else ()
        text = final_text(committed, tail.text)
        return self._transcribed(turn, text, logprobs=logprobs, live=bool(committed))

    async def _asr(self, turn: Turn, inputs: Any) -> Any:
        """The ASR stage's finished payload for `inputs`; None if it failed (the turn
        failed with it) or was aborted."""
        async for out in self.engine.stream("asr", turn.ids[ASR], inputs):
            if out.error is not None:
                self.fail(turn, ASR, out.error)
                return None
            if out.finished:
                turn.asr_metrics = dict(out.metrics)
                return out.payload
        return None  # aborted: the stream ended without a result

    def _transcribed(
        self,
        turn: Turn,
        text: str,
        *,
        logprobs: tuple[tuple[str, float], ...] = (),
        live: bool = False,
        heard: bool = False,
    ) -> str:
        metadata: dict[str, Any] = {"asr_ms": turn.since("asr"), **turn.asr_metrics}
        if logprobs:
            metadata["logprobs"] = logprobs
        if live:
            metadata["live"] = True
        if heard:
            metadata["heard"] = True  # the speech detection's words: no transcription ran
        turn.transcribed = True
        self.emit(turn, ASR, "transcript", text=text, metadata=metadata)
        self.emit(turn, ASR, "done", finished=True)
        return text

    async def _respond(self, turn: Turn, text: str | None) -> None:
        """Answer `text`, or with no new input (None) continue from the history."""
        if text is not None and not text.strip():
            # Nothing was said: the turn ends without asking the model.
            self.emit(turn, LLM, "done", finished=True, metadata={"skipped": True})
            self.emit(turn, TTS, "done", finished=True, metadata={"skipped": True})
            return
        speaker = _Speaker(self, turn) if turn.request.final is TTS else None
        speaking = asyncio.create_task(speaker.run()) if speaker else None
        try:
            final = await self._generate(turn, text, speaker)
            if final is not None and speaking is not None:
                await speaking
        finally:
            if speaking is not None and not speaking.done():
                speaking.cancel()
                self.engine.abort("tts", turn.ids[TTS])

    async def _generate(
        self, turn: Turn, text: str | None, speaker: _Speaker | None
    ) -> RequestOutput | None:
        rid = turn.ids[LLM]
        inputs = self._llm_inputs(turn, text)
        splitter = ClauseSplitter(**self.config.clauses.model_dump())
        turn.marks["llm"] = time.perf_counter()
        final: RequestOutput | None = None
        async for out in self.llm.stream(rid, inputs):
            if out.error is not None:
                self.fail(turn, LLM, out.error, code=out.error_code)
                return None
            delta: RequestOutput = out.payload
            for call in delta.tool_calls:  # never spoken
                metadata = {"index": call.index, "name": call.name}
                self.emit(turn, LLM, "tool_call", text=call.arguments, metadata=metadata)
            if delta.new_text:
                self.emit(turn, LLM, "text", text=delta.new_text)
                if speaker is not None:
                    speaker.say(splitter.push(delta.new_text))
            if out.finished:
                final = delta
        if final is None:
            return None
        metadata = {
            # With the prompt tokens its KV was reused for, for the usage's cached_tokens.
            "usage": {**final.usage(), "cached_tokens": final.cached_tokens},
            "finish_reason": final.finish_reason,
            "cached_tokens": final.cached_tokens,
            "llm_ms": turn.since("llm"),
        }
        logger.debug("LLM of %s done: %s", rid, metadata)
        self.emit(turn, LLM, "done", finished=True, metadata=metadata)
        if speaker is not None:
            speaker.finish(splitter.flush())
        return final

    def _llm_inputs(self, turn: Turn, text: str | None) -> LlmInput:
        request = turn.request
        messages = chat_messages(request.messages, self.config.system_prompt, text)
        params: SamplingParams = turn.params[LLM]
        if request.max_output_tokens is not None:
            params = dataclasses.replace(params, max_tokens=request.max_output_tokens)
        if request.temperature is not None:
            params = dataclasses.replace(params, temperature=request.temperature)
        return LlmInput(
            messages=messages,
            sampling_params=params,
            cache_key=request.cache_key,
            truncate=request.truncate,
            retention_ratio=request.retention_ratio,
            post_instructions_tokens=request.post_instructions_tokens,
            tools=chat_tools(request.tools),
            tool_choice=chat_tool_choice(request.tool_choice),
            parallel_tool_calls=request.parallel_tool_calls,
        )


class _Speaker:
    """Stage 2 of one turn: feeds clauses to the TTS stage in order, emits its audio.

    It also tells the engine's LLM stage how much speech the listener has queued (audio
    not yet played, text not yet spoken), so that the LLM does not race ahead of it.
    """

    def __init__(self, runner: TurnRunner, turn: Turn) -> None:
        self._runner = runner
        self._turn = turn
        self._rid = turn.ids[TTS]
        self._queue: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
        self._first_chunk = True
        self._paces_llm = isinstance(runner.llm, EngineLlm)
        self._unspoken_chars = 0
        self._heard_from: float | None = None  # monotonic time of the first chunk
        self._audio_s = 0.0

    def say(self, clauses: list[str]) -> None:
        for clause in clauses:
            if "clause" not in self._turn.marks:
                self._turn.marks["clause"] = time.perf_counter()
                self._turn.marks["llm_first_clause_ms"] = self._turn.since("llm")
            self._queue.put_nowait((clause, False))
            self._unspoken_chars += len(clause)
        if clauses:
            self._pace()

    def _pace(self) -> None:
        if not self._paces_llm:
            return
        in_hand = 0.0
        if self._heard_from is not None:
            in_hand = max(0.0, self._heard_from + self._audio_s - time.monotonic())
        seconds = in_hand + max(0, self._unspoken_chars) / CHARS_PER_SPEECH_S
        request_id = self._turn.ids[LLM]
        clients.llm(self._runner.engine).notify(lambda llm: llm.set_runway(request_id, seconds))

    def finish(self, clauses: list[str]) -> None:
        self.say(clauses)
        self._queue.put_nowait(("", True))

    async def run(self) -> None:
        text, final = await self._queue.get()
        if final:
            # The reply had no speakable text: stage 2 ends without a request.
            self._runner.emit(self._turn, TTS, "done", finished=True)
            return
        engine, rid = self._runner.engine, self._rid
        tts = clients.tts(engine)
        stream = engine.stream("tts", rid, self._tts_request())
        consumer = asyncio.create_task(self._consume(stream))
        try:
            while not final:
                # Waited for: the stage has the text before `text` changes.
                await tts.run(lambda stage: stage.feed(rid, text, False))  # noqa: B023
                text, final = await self._queue.get()
            await tts.run(lambda stage: stage.feed(rid, "", True))
            await consumer
        except Exception:
            if consumer.done():
                return  # the stage already failed the request; its error was emitted
            raise
        finally:
            if not consumer.done():
                consumer.cancel()

    def _tts_request(self) -> Any:
        from engine.stages.tts import TtsRequest

        request = self._turn.request
        base: TtsParams = self._turn.params[TTS]
        speed = request.speed if request.speed is not None else base.speed
        voice = request.voice if request.voice is not None else base.voice
        return TtsRequest(
            speed=speed, noise_scale=base.noise_scale, noise_w=base.noise_w, voice=voice
        )

    async def _consume(self, stream: AsyncIterator[StageOutput]) -> None:
        async for out in stream:
            if out.error is not None:
                self._runner.fail(self._turn, TTS, out.error)
                return
            chunk = out.payload
            if chunk is not None and len(chunk.samples):
                self._emit_chunk(chunk)
            if out.finished:
                self._runner.emit(self._turn, TTS, "done", finished=True)
                return

    def _emit_chunk(self, chunk: Any) -> None:
        if self._heard_from is None:
            self._heard_from = time.monotonic()
        self._audio_s += chunk.duration_ms / 1000
        self._unspoken_chars -= len(chunk.text)
        self._pace()
        metadata: dict[str, Any] = {"duration_ms": chunk.duration_ms}
        if self._first_chunk:
            self._first_chunk = False
            marks = self._turn.marks
            metadata.update(
                first_audio_ms=self._turn.since("submit"),
                tts_first_chunk_ms=self._turn.since("clause"),
                llm_first_clause_ms=marks.get("llm_first_clause_ms", 0.0),
            )
            logger.debug(
                "first audio of %s: %.0f ms after its start, first clause after %.0f ms, "
                "spoken in %.0f ms",
                self._rid,
                metadata["first_audio_ms"],
                metadata["llm_first_clause_ms"],
                metadata["tts_first_chunk_ms"],
            )
        self._runner.emit(
            self._turn,
            TTS,
            "audio",
            text=chunk.text,
            audio=chunk.samples.astype("<f4", copy=False).tobytes(),
            sample_rate=chunk.sample_rate,
            metadata=metadata,
        )
