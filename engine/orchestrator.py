"""The multi-stage pipeline (ASR → LLM → TTS) behind the duplex stage port.

One submitted turn (a `duplex.turn.TurnRequest`, read typed from the submission's
prompt) is one asyncio task on the event loop: it streams the turn's audio through the
ASR stage, the transcript and history through the LLM, and each complete clause of the
LLM's text through the TTS stage while the LLM is still decoding. The model work runs
on the engine thread; this task only moves results between stages and hands them to
the sink. Batching across sessions happens inside each stage, which sees every
session's requests at once.

Rules of this module:
1. Every output carries its own stage request id (`...r.stage{N}-turn{T}`), so the
   session core can tell its fence and drop stale ones.
2. An id is "open" from submit until its stage's finished output, its abort, or its
   cleanup. Only open ids are emitted; abort and cleanup close ids synchronously, so
   nothing of an aborted request reaches the sink once `abort_requests` returns (the
   port's contract). The duplex session filters stale outputs; this is the one guard
   below it, for outputs a stopping turn's task could still produce.
3. A failing stage ends its turn with one `error` output on that stage's id; the turn's
   later stages emit nothing.
4. A prepared turn (`prepare_turn`, one per session) runs like any other under engine
   request ids of its own, but its outputs are held. A submission with an equal turn
   request (and the same session config and sampling) adopts it: the held outputs go out
   first, under the submission's ids, and the rest follows as it comes. Any other
   submission of the session, or `discard_prepared`, stops it and drops what it held.
5. The session's resident stage-0 request (`...r.stage0`, `duplex.session` rule 4)
   takes resumable submissions: each is one `duplex.appends` value for the session's
   `engine.listener.Listener`, which hears the audio, follows the utterance and, while
   listening, emits its live transcript deltas on the resident id. A turn whose
   `TurnRequest.utterance` is the utterance under way finishes that live transcript
   over the turn's own audio (only the tail is left to decode) instead of starting
   over; a prepared turn does the same with its outputs held, and a turn stopped before
   its transcript went out gives the utterance back for the turn that takes over.
   Aborting the resident id ends its live work at once (rule 2); an utterance still
   spoken goes on live under the next epoch's resident id, which the listener attaches
   to on its first submission.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from duplex.appends import read_append
from duplex.contracts import (
    DuplexFence,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    DuplexStageSubmissionResult,
    duplex_ephemeral_stage_request_id,
    duplex_resource_request_id,
    duplex_turn_id_from_request_id,
)
from duplex.outputs import DuplexPreparedTurn, DuplexStageOutput, DuplexStreamingStagePort
from duplex.session import RESIDENT_ROLE
from duplex.turn import Message, Stage, Tool, ToolChoice, TurnRequest
from engine import clients, memory
from engine.clauses import ClauseSplitter
from engine.config import EngineConfig
from engine.core import AsyncEngine
from engine.listener import Listener, Utterance, final_text
from engine.llm import LlmInput
from engine.request import RequestOutput, SamplingParams
from engine.stage import StageOutput

__all__ = ["AsrParams", "DuplexOrchestrator", "EngineLlm", "LlmBackend", "TtsParams"]

logger = logging.getLogger(__name__)

ASR, LLM, TTS = Stage.ASR, Stage.LLM, Stage.TTS
# The engine stage that runs each pipeline stage.
STAGE_ENGINES = {ASR: "asr", LLM: "llm", TTS: "tts"}
# Characters of text per second of speech (the default voice at speed 1): how a speaker
# turns its unspoken text into seconds for the LLM stage's pacing (`set_runway`).
CHARS_PER_SPEECH_S = 14.0


@dataclass(frozen=True)
class AsrParams:
    """Stage-0 options: turns with more audio than `max_audio_s` are refused."""

    max_audio_s: float = 120.0


@dataclass(frozen=True)
class TtsParams:
    """Stage-2 options: which voice speaks, how fast, and its noise settings."""

    voice: str
    speed: float = 1.0
    noise_scale: float | None = None
    noise_w: float | None = None


class LlmBackend(Protocol):
    """Where stage 1 runs: the engine's LLM stage, or a remote server."""

    def stream(self, request_id: str, inputs: LlmInput) -> AsyncIterator[StageOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def forget(self, cache_key: str) -> None:
        """The conversation under `cache_key` is over: free what is cached for it."""


class EngineLlm:
    """The engine thread's "llm" stage as an `LlmBackend`."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def stream(self, request_id: str, inputs: LlmInput) -> AsyncIterator[StageOutput]:
        return self._engine.stream("llm", request_id, inputs)

    def abort(self, request_id: str) -> None:
        self._engine.abort("llm", request_id)

    def forget(self, cache_key: str) -> None:
        # Queued behind the session's aborts, which the engine thread takes first.
        clients.llm(self._engine).notify(lambda llm: llm.forget(cache_key))


@dataclass
class _Turn:
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


@dataclass
class _SessionParams:
    generation: int
    params: tuple[Any, ...]


@dataclass
class _Prepared:
    spec: DuplexPreparedTurn
    turn: _Turn


class DuplexOrchestrator(DuplexStreamingStagePort):
    """Runs each submitted turn through ASR, LLM and TTS; see the module docstring."""

    def __init__(
        self, engine: AsyncEngine, config: EngineConfig, *, llm: LlmBackend | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.llm: LlmBackend = llm if llm is not None else EngineLlm(engine)
        self._sink: Callable[[DuplexStageOutput], None] | None = None
        self._reserved: dict[str, DuplexStageRequestContext] = {}
        self._sessions: dict[str, _SessionParams] = {}
        self._turns: dict[str, _Turn] = {}  # every id of a running turn -> the turn
        self._open: set[str] = set()
        self._prepared: dict[str, _Prepared] = {}  # session id -> its prepared turn
        self._listeners: dict[str, Listener] = {}  # session id -> its live input (rule 5)
        self._cache_keys: dict[str, set[str]] = {}  # session id -> its LLM prompt-cache keys
        self._resident_submitted: set[str] = set()
        self._serial = itertools.count()
        self.prepare_stats = {"adopted": 0, "discarded": 0}

    # --- DuplexStagePort -------------------------------------------------------------

    @property
    def stage_count(self) -> int:
        return len(Stage)

    def sampling_defaults(self) -> tuple[Any, ...]:
        stages = self.config.stages
        tts = stages.tts
        return (
            AsrParams(max_audio_s=stages.asr.max_audio_s),
            stages.llm.sampling.to_params(),
            TtsParams(tts.voice, tts.speed, tts.noise_scale, tts.noise_w),
        )

    def attach_output_sink(self, sink: Callable[[DuplexStageOutput], None]) -> None:
        self._sink = sink

    def ensure_request(self, context: DuplexStageRequestContext) -> None:
        if not 0 <= context.stage_id < self.stage_count:
            raise ValueError(f"stage {context.stage_id} does not exist (0..{self.stage_count - 1})")
        if len(context.sampling_params) != self.stage_count:
            raise ValueError(f"sampling_params needs one entry per stage ({self.stage_count})")
        _check_params(context.sampling_params)
        if _is_resident(context) and (context.stage_id, context.final_stage_id) != (0, 0):
            raise ValueError(f"resident request {context.request_id!r} runs stage 0 alone")
        self._reserved[context.request_id] = context
        if _is_resident(context) and context.session_id not in self._listeners:
            self._listeners[context.session_id] = self._new_listener(context.session_id)
        cached = self._sessions.get(context.session_id)
        if cached is None or cached.generation != context.config_generation:
            self._sessions[context.session_id] = _SessionParams(
                context.config_generation, context.sampling_params
            )

    async def submit(self, submission: DuplexStageSubmission) -> DuplexStageSubmissionResult:
        """Start a turn's pipeline; the prompt holds its `TurnRequest` (`duplex.turn`).

        Raises ValueError for an unreserved or reused id, a prompt without a turn
        request, stages that do not match it, or a turn this engine cannot serve (audio
        over the ASR limit, a voice it does not have).
        """
        context = submission.context
        rid = context.request_id
        if rid not in self._reserved:
            raise ValueError(f"request {rid!r} was not reserved with ensure_request")
        if _is_resident(context):
            self._append(submission)
            return DuplexStageSubmissionResult(request_id=rid, stage_id=0, replica_id=0)
        if submission.already_submitted or rid in self._turns:
            raise ValueError(f"request {rid!r} was already submitted; a turn takes one prompt")
        if duplex_turn_id_from_request_id(rid) is None:
            raise ValueError(f"request {rid!r} is not a per-turn (stage{{N}}-turn{{T}}) id")
        params = self._sessions[context.session_id].params
        request = self._read_turn(
            submission.prompt, context.stage_id, context.final_stage_id, params
        )
        prepared = self._take_prepared(context, request, params)
        if prepared is not None:
            self._adopt(prepared, context)
        else:
            self._start_turn(context, request, params)
        return DuplexStageSubmissionResult(request_id=rid, stage_id=context.stage_id, replica_id=0)

    def prepare_turn(self, turn: DuplexPreparedTurn) -> None:
        """Start `turn` with its outputs held (rule 4); it replaces the session's
        previous prepared turn. A turn `submit` would refuse is not prepared."""
        self.discard_prepared(turn.session_id)
        try:
            _check_params(turn.sampling_params)
            request = self._read_turn(
                turn.prompt, turn.entry_stage_id, turn.final_stage_id, turn.sampling_params
            )
        except ValueError as exc:
            logger.debug("turn of %s not prepared: %s", turn.session_id, exc)
            return
        serial = next(self._serial)
        ids = {
            stage: f"{turn.session_id}.prepared{serial}.stage{stage}"
            for stage in range(turn.entry_stage_id, turn.final_stage_id + 1)
        }
        work = _Turn(turn.session_id, ids, {}, request, turn.sampling_params, held=[])
        work.utterance = self._claim(turn.session_id, request)
        self._prepared[turn.session_id] = _Prepared(turn, work)
        self._launch(work)

    def discard_prepared(self, session_id: str) -> None:
        prepared = self._prepared.pop(session_id, None)
        if prepared is not None:
            self.prepare_stats["discarded"] += 1
            self._stop(prepared.turn)

    async def abort_requests(self, request_ids: list[str]) -> None:
        listening = self._stop_listening(request_ids)
        turns = self._close(request_ids)
        for turn in turns:
            self._stop(turn)
        await self._wait_stopped(turns)
        if listening:
            await asyncio.wait(listening)

    async def cleanup(self, request_ids: list[str], *, abort: bool = False) -> None:
        """Forget the ids. A cleaned-up id never outputs again, so a turn still running is
        stopped whether or not `abort` is set."""
        await self.abort_requests(request_ids)
        for rid in request_ids:
            self._resident_submitted.discard(rid)
            context = self._reserved.pop(rid, None)
            if context is not None and not self._session_has_requests(context.session_id):
                self._sessions.pop(context.session_id, None)
                self._listeners.pop(context.session_id, None)

    def close_session(self, session_id: str) -> None:
        """The session is over (closed, dropped or drained): free everything kept for it,
        its live input and the LLM's cached context included."""
        self.discard_prepared(session_id)
        self._sessions.pop(session_id, None)
        self._listeners.pop(session_id, None)
        for key in self._cache_keys.pop(session_id, ()):
            self.llm.forget(key)
        if self.session_count() == 0:
            # On every engine thread, behind the session's aborts and forgets queued there:
            # what each of them frees afterwards goes back too, whichever thread ends last.
            self.engine.notify_each_thread(memory.release_free_memory)

    def session_count(self) -> int:
        """Sessions this port still keeps something for (0 once every one has closed)."""
        kept = {*self._sessions, *self._listeners, *self._cache_keys, *self._prepared}
        return len(kept | {c.session_id for c in self._reserved.values()})

    def listener_count(self) -> int:
        return len(self._listeners)

    def listened_bytes(self) -> int:
        """Audio the sessions' listeners hold (for /metrics)."""
        return sum(listener.heard.nbytes for listener in list(self._listeners.values()))

    async def shutdown(self) -> None:
        """Stop every running and prepared turn; nothing more reaches the sink."""
        for session_id in list(self._prepared):
            self.discard_prepared(session_id)
        residents = [rid for rid in self._reserved if _is_resident(self._reserved[rid])]
        await self.abort_requests([*self._turns, *residents])

    # --- introspection ---------------------------------------------------------------

    def running_turns(self) -> int:
        return len({id(t) for t in self._turns.values()})

    def reserved_requests(self) -> int:
        return len(self._reserved)

    def prepared_turns(self) -> int:
        return len(self._prepared)

    def listener(self, session_id: str) -> Listener | None:
        """The session's live input (rule 5), once its resident request is reserved."""
        return self._listeners.get(session_id)

    # --- the resident stage-0 request (rule 5) ---------------------------------------

    def _new_listener(self, session_id: str) -> Listener:
        asr = self.config.stages.asr
        return Listener(
            session_id,
            self.engine,
            interval_ms=asr.live_interval_ms,
            max_audio_s=asr.max_audio_s,
            emit=lambda rid, utterance_id, text, logprobs: self._emit_delta(
                session_id, rid, utterance_id, text, logprobs
            ),
        )

    def _append(self, submission: DuplexStageSubmission) -> None:
        rid = submission.context.request_id
        if submission.already_submitted != (rid in self._resident_submitted):
            state = "was" if rid in self._resident_submitted else "was not"
            raise ValueError(
                f"resident request {rid!r} {state} submitted before; already_submitted="
                f"{submission.already_submitted} disagrees"
            )
        if not submission.resumable:
            raise ValueError(f"resident request {rid!r} takes resumable submissions only")
        append = read_append(submission.prompt)
        listener = self._listeners[submission.context.session_id]
        if rid not in self._resident_submitted:
            self._resident_submitted.add(rid)
            listener.attach(rid)
        listener.apply(append)

    def _emit_delta(
        self,
        session_id: str,
        rid: str,
        utterance_id: str,
        text: str,
        logprobs: tuple[tuple[str, float], ...],
    ) -> None:
        metadata: dict[str, Any] = {"utterance_id": utterance_id}
        if logprobs:
            metadata["logprobs"] = logprobs
        if self._sink is not None:
            self._sink(
                DuplexStageOutput(
                    session_id=session_id,
                    request_id=rid,
                    stage_id=ASR,
                    kind="transcript_delta",
                    text=text,
                    metadata=metadata,
                )
            )

    def _stop_listening(self, request_ids: list[str]) -> list[asyncio.Task[None]]:
        """Stop the live work of the resident ids among `request_ids` (rule 2)."""
        tasks = []
        for rid in request_ids:
            context = self._reserved.get(rid)
            listener = None if context is None else self._listeners.get(context.session_id)
            if listener is not None and listener.resident_id == rid:
                task = listener.stop()
                if task is not None and task is not asyncio.current_task():
                    tasks.append(task)
        return tasks

    def _claim(self, session_id: str, request: TurnRequest) -> Utterance | None:
        listener = self._listeners.get(session_id)
        if listener is None or request.utterance is None or request.audio is None:
            return None
        return listener.claim(request.utterance)

    # --- turn lifecycle --------------------------------------------------------------

    def _read_turn(
        self, prompt: Mapping[str, object], entry: int, final: int, params: tuple[Any, ...]
    ) -> TurnRequest:
        """The submission's turn request, once this engine can serve it as reserved."""
        request = TurnRequest.from_plan(prompt)
        if (entry, final) != (request.entry, request.final):
            raise ValueError(
                f"stages {entry}..{final} were reserved for a turn that runs "
                f"{request.entry.name}..{request.final.name}"
            )
        self._check_audio_length(request, params[ASR])
        self._check_voice(request, params[TTS])
        return request

    def _start_turn(
        self, context: DuplexStageRequestContext, request: TurnRequest, params: tuple[Any, ...]
    ) -> _Turn:
        fence: DuplexFence = context.fence
        ids = {
            stage: duplex_ephemeral_stage_request_id(fence, stage_id=stage)
            for stage in range(context.stage_id, context.final_stage_id + 1)
        }
        turn = _Turn(context.session_id, ids, dict(ids), request, params)
        turn.utterance = self._claim(context.session_id, request)
        self._register(turn)
        self._launch(turn)
        return turn

    def _register(self, turn: _Turn) -> None:
        for rid in turn.out_ids.values():
            self._turns[rid] = turn
            self._open.add(rid)

    def _launch(self, turn: _Turn) -> None:
        if turn.request.cache_key is not None:
            self._cache_keys.setdefault(turn.session_id, set()).add(turn.request.cache_key)
        turn.marks["submit"] = time.perf_counter()
        turn.task = asyncio.create_task(self._run(turn), name=f"turn {turn.ids[min(turn.ids)]}")
        turn.task.add_done_callback(lambda _: self._forget(turn))

    def _take_prepared(
        self, context: DuplexStageRequestContext, request: TurnRequest, params: tuple[Any, ...]
    ) -> _Turn | None:
        """The session's prepared turn if it equals this submission; else it is stopped."""
        prepared = self._prepared.pop(context.session_id, None)
        if prepared is None:
            return None
        spec, turn = prepared.spec, prepared.turn
        same = (
            spec.config_generation == context.config_generation
            and spec.entry_stage_id == context.stage_id
            and spec.final_stage_id == context.final_stage_id
            and turn.params == params
            and turn.request == request
        )
        if not same:
            self.prepare_stats["discarded"] += 1
            self._stop(turn)
            return None
        self.prepare_stats["adopted"] += 1
        return turn

    def _adopt(self, turn: _Turn, context: DuplexStageRequestContext) -> None:
        """Rule 4: the submission's ids take over the prepared turn's outputs."""
        turn.out_ids = {
            stage: duplex_ephemeral_stage_request_id(context.fence, stage_id=stage)
            for stage in turn.ids
        }
        self._register(turn)
        turn.marks["adopted"] = time.perf_counter()
        held, turn.held = turn.held or [], None
        logger.debug(
            "prepared turn %s adopted %.0f ms after its start, %d audio chunks ready",
            turn.ids[min(turn.ids)],
            turn.since("submit"),
            sum(kind == "audio" for _, kind, _ in held),
        )
        for stage, kind, fields in held:
            self._emit(turn, stage, kind, **fields)
        if turn.task is not None and turn.task.done():
            self._forget(turn)  # it finished while held: its done callback found no ids

    def _close(self, request_ids: list[str]) -> list[_Turn]:
        """Close the ids and return their running turns (each once)."""
        turns: dict[int, _Turn] = {}
        for rid in request_ids:
            self._open.discard(rid)
            turn = self._turns.get(rid)
            if turn is not None:
                turns[id(turn)] = turn
        return list(turns.values())

    def _stop(self, turn: _Turn) -> None:
        """Stop a turn at once: no id of it outputs again, every stage drops its request;
        a live utterance it had not transcribed yet goes back to the listener (rule 5)."""
        unfinished = turn.held is not None or not turn.transcribed
        listener = self._listeners.get(turn.session_id)
        if turn.utterance is not None and unfinished and listener is not None:
            listener.release(turn.utterance)
        turn.utterance = None
        for rid in turn.out_ids.values():
            self._open.discard(rid)
        if turn.task is not None and turn.task is not asyncio.current_task():
            turn.task.cancel()
        for stage, rid in turn.ids.items():
            if stage == LLM:
                self.llm.abort(rid)
            else:
                self.engine.abort(STAGE_ENGINES[Stage(stage)], rid)

    async def _wait_stopped(self, turns: list[_Turn]) -> None:
        current = asyncio.current_task()
        tasks = [t.task for t in turns if t.task is not None and t.task is not current]
        if tasks:
            await asyncio.wait(tasks)

    def _forget(self, turn: _Turn) -> None:
        for rid in turn.out_ids.values():
            self._open.discard(rid)
            if self._turns.get(rid) is turn:
                del self._turns[rid]

    def _session_has_requests(self, session_id: str) -> bool:
        return any(c.session_id == session_id for c in self._reserved.values())

    def _check_audio_length(self, request: TurnRequest, asr: AsrParams) -> None:
        if request.audio_seconds > asr.max_audio_s:
            raise ValueError(
                f"turn audio is {request.audio_seconds:.1f} s; the limit is {asr.max_audio_s} s"
            )

    def _check_voice(self, request: TurnRequest, tts: TtsParams) -> None:
        # One voice model is loaded; a turn or session asking for another is refused.
        voice = request.voice if request.voice is not None else tts.voice
        if request.final is TTS and voice != self.config.stages.tts.voice:
            raise ValueError(
                f"unknown voice {voice!r}; this engine speaks with {self.config.stages.tts.voice!r}"
            )

    # --- output ----------------------------------------------------------------------

    def _emit(self, turn: _Turn, stage: int, kind: str, **fields: Any) -> None:
        if turn.held is not None:
            if stage in turn.ids and stage not in turn.held_finished:
                if fields.get("finished"):
                    turn.held_finished.add(stage)
                turn.held.append((stage, kind, fields))
            return
        rid = turn.out_ids.get(stage)
        if rid is None or rid not in self._open:
            return  # aborted, cleaned up or already finished: dropped by rule 2
        if fields.get("finished"):
            self._open.discard(rid)
        if self._sink is None:
            return
        self._sink(
            DuplexStageOutput(
                session_id=turn.session_id, request_id=rid, stage_id=stage, kind=kind, **fields
            )
        )

    def _fail(self, turn: _Turn, stage: int, error: str, *, code: str | None = None) -> None:
        """Rule 3: one error output on `stage`, then the whole turn is stopped."""
        metadata = {"error": error} if code is None else {"error": error, "error_code": code}
        self._emit(turn, stage, "error", finished=True, metadata=metadata)
        self._stop(turn)

    # --- the pipeline ----------------------------------------------------------------

    async def _run(self, turn: _Turn) -> None:
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
                self._fail(turn, still_open[0], f"{type(exc).__name__}: {exc}")

    def _open_stages(self, turn: _Turn) -> list[int]:
        if turn.held is not None:
            return [s for s in sorted(turn.ids) if s not in turn.held_finished]
        return [s for s, rid in sorted(turn.out_ids.items()) if rid in self._open]

    async def _transcribe(self, turn: _Turn) -> str | None:
        """Stage 0 of a turn: finish the live utterance it names (rule 5), report the
        words the gateway already heard, or transcribe its audio whole, with a transcript
        of its own when it asks for a prompt or logprobs."""
        request = turn.request
        turn.marks["asr"] = time.perf_counter()
        audio = np.frombuffer(request.audio or b"", dtype="<f4")
        utterance = turn.utterance
        live = utterance.live if utterance is not None else None
        if live is None and request.heard is not None:
            return self._transcribed(turn, request.heard.strip(), heard=True)
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

    async def _asr(self, turn: _Turn, inputs: Any) -> Any:
        """The ASR stage's finished payload for `inputs`; None if it failed (the turn
        failed with it) or was aborted."""
        async for out in self.engine.stream("asr", turn.ids[ASR], inputs):
            if out.error is not None:
                self._fail(turn, ASR, out.error)
                return None
            if out.finished:
                turn.asr_metrics = dict(out.metrics)
                return out.payload
        return None  # aborted: the stream ended without a result

    def _transcribed(
        self,
        turn: _Turn,
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
            metadata["heard"] = True  # the turn detector's words: no transcription ran
        turn.transcribed = True
        self._emit(turn, ASR, "transcript", text=text, metadata=metadata)
        self._emit(turn, ASR, "done", finished=True)
        return text

    async def _respond(self, turn: _Turn, text: str | None) -> None:
        """Answer `text`, or with no new input (None) continue from the history."""
        if text is not None and not text.strip():
            # Nothing was said: the turn ends without asking the model.
            self._emit(turn, LLM, "done", finished=True, metadata={"skipped": True})
            self._emit(turn, TTS, "done", finished=True, metadata={"skipped": True})
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
        self, turn: _Turn, text: str | None, speaker: _Speaker | None
    ) -> RequestOutput | None:
        rid = turn.ids[LLM]
        inputs = self._llm_inputs(turn, text)
        splitter = ClauseSplitter(**self.config.clauses.model_dump())
        turn.marks["llm"] = time.perf_counter()
        final: RequestOutput | None = None
        async for out in self.llm.stream(rid, inputs):
            if out.error is not None:
                self._fail(turn, LLM, out.error, code=out.error_code)
                return None
            delta: RequestOutput = out.payload
            for call in delta.tool_calls:  # never spoken
                metadata = {"index": call.index, "name": call.name}
                self._emit(turn, LLM, "tool_call", text=call.arguments, metadata=metadata)
            if delta.new_text:
                self._emit(turn, LLM, "text", text=delta.new_text)
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
        self._emit(turn, LLM, "done", finished=True, metadata=metadata)
        if speaker is not None:
            speaker.finish(splitter.flush())
        return final

    def _llm_inputs(self, turn: _Turn, text: str | None) -> LlmInput:
        request = turn.request
        messages = [_chat_message(m) for m in request.messages]
        if not messages or messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        if text is not None:
            messages.append({"role": "user", "content": text})
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
            tools=[_chat_tool(t) for t in request.tools] or None,
            tool_choice=_chat_tool_choice(request.tool_choice),
            parallel_tool_calls=request.parallel_tool_calls,
        )

    def _tts_request(self, turn: _Turn) -> Any:
        from engine.tts import TtsRequest

        base: TtsParams = turn.params[TTS]
        speed = turn.request.speed if turn.request.speed is not None else base.speed
        return TtsRequest(
            speed=speed,
            noise_scale=base.noise_scale,
            noise_w=base.noise_w,
        )


class _Speaker:
    """Stage 2 of one turn: feeds clauses to the TTS stage in order, emits its audio.

    It also tells the engine's LLM stage how much speech the listener has queued (audio
    not yet played, text not yet spoken), so that the LLM does not race ahead of it.
    """

    def __init__(self, orchestrator: DuplexOrchestrator, turn: _Turn) -> None:
        self._orch = orchestrator
        self._turn = turn
        self._rid = turn.ids[TTS]
        self._queue: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
        self._first_chunk = True
        self._paces_llm = isinstance(orchestrator.llm, EngineLlm)
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
        clients.llm(self._orch.engine).notify(lambda llm: llm.set_runway(request_id, seconds))

    def finish(self, clauses: list[str]) -> None:
        self.say(clauses)
        self._queue.put_nowait(("", True))

    async def run(self) -> None:
        text, final = await self._queue.get()
        if final:
            # The reply had no speakable text: stage 2 ends without a request.
            self._orch._emit(self._turn, TTS, "done", finished=True)
            return
        engine, rid = self._orch.engine, self._rid
        tts = clients.tts(engine)
        stream = engine.stream("tts", rid, self._orch._tts_request(self._turn))
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

    async def _consume(self, stream: AsyncIterator[StageOutput]) -> None:
        async for out in stream:
            if out.error is not None:
                self._orch._fail(self._turn, TTS, out.error)
                return
            chunk = out.payload
            if chunk is not None and len(chunk.samples):
                self._emit_chunk(chunk)
            if out.finished:
                self._orch._emit(self._turn, TTS, "done", finished=True)
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
        self._orch._emit(
            self._turn,
            TTS,
            "audio",
            text=chunk.text,
            audio=chunk.samples.astype("<f4", copy=False).tobytes(),
            sample_rate=chunk.sample_rate,
            metadata=metadata,
        )


def _chat_message(message: Message) -> dict[str, Any]:
    """A turn's message in the chat-completions shape."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _chat_tool(tool: Tool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.schema}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.name is not None:
        return {"type": "function", "function": {"name": choice.name}}
    return choice.mode


def _is_resident(context: DuplexStageRequestContext) -> bool:
    """Whether `context` names its session's resident stage-0 request of its epoch."""
    return context.request_id == duplex_resource_request_id(context.fence, RESIDENT_ROLE)


def _check_params(params: tuple[Any, ...]) -> None:
    expected = (AsrParams, SamplingParams, TtsParams)
    for stage, (value, kind) in enumerate(zip(params, expected, strict=True)):
        if not isinstance(value, kind):
            raise ValueError(
                f"sampling_params[{stage}] must be {kind.__name__}, got {type(value).__name__}"
            )
