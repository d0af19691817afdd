"""The multi-stage pipeline (ASR → LLM → TTS) behind the duplex stage port.

`DuplexOrchestrator` keeps the port's books: the requests each session reserved and
submitted, the sessions' stage options, their live inputs and prepared turns, and which
turn runs under which ids. One submitted turn (a `duplex.turn.TurnRequest`, read typed
from the submission's prompt) is one asyncio task of `engine.pipeline.turn_runner`, which streams
it through the stages and hands their outputs to the sink. Batching across sessions
happens inside each stage, which sees every session's requests at once.

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
   `engine.listening.listener.Listener`, which hears the audio, detects speech in it (emitting
   each decision as a `"speech"` output on the resident id), follows the utterance and,
   while listening, emits its live transcript deltas on the resident id. A turn whose
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
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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
from duplex.turn import Stage, TurnRequest
from engine.config import EngineConfig
from engine.listening.listener import Listener, Utterance
from engine.llm.backend import EngineLlm, LlmBackend
from engine.pipeline.turn_runner import Turn, TurnRunner
from engine.runtime import memory
from engine.runtime.core import AsyncEngine
from engine.runtime.stage_params import AsrParams, TtsParams, check_params

__all__ = ["AsrParams", "DuplexOrchestrator", "EngineLlm", "LlmBackend", "TtsParams"]

logger = logging.getLogger(__name__)

ASR, TTS = Stage.ASR, Stage.TTS


@dataclass
class _SessionParams:
    generation: int
    params: tuple[Any, ...]


@dataclass
class _Prepared:
    spec: DuplexPreparedTurn
    turn: Turn


class DuplexOrchestrator(DuplexStreamingStagePort):
    """Runs each submitted turn through ASR, LLM and TTS; see the module docstring."""

    def __init__(
        self,
        engine: AsyncEngine,
        config: EngineConfig,
        *,
        llm: LlmBackend | None = None,
        voices: tuple[str, ...] | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        # The TTS stage's voices, its default first (`engine.build.voice_table`).
        self.voices = voices or (config.stages.tts.voice_name,)
        self.llm: LlmBackend = llm if llm is not None else EngineLlm(engine)
        self._reserved: dict[str, DuplexStageRequestContext] = {}
        self._sessions: dict[str, _SessionParams] = {}
        self._turns: dict[str, Turn] = {}  # every id of a running turn -> the turn
        self._prepared: dict[str, _Prepared] = {}  # session id -> its prepared turn
        self._listeners: dict[str, Listener] = {}  # session id -> its live input (rule 5)
        # The runner reads the listeners: a turn it stops gives its utterance back.
        self._runner = TurnRunner(engine, config, self.llm, self._listeners)
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
            TtsParams(self.voices[0], tts.speed, tts.noise_scale, tts.noise_w),
        )

    def attach_output_sink(self, sink: Callable[[DuplexStageOutput], None]) -> None:
        self._runner.sink = sink

    def ensure_request(self, context: DuplexStageRequestContext) -> None:
        if not 0 <= context.stage_id < self.stage_count:
            raise ValueError(f"stage {context.stage_id} does not exist (0..{self.stage_count - 1})")
        if len(context.sampling_params) != self.stage_count:
            raise ValueError(f"sampling_params needs one entry per stage ({self.stage_count})")
        check_params(context.sampling_params)
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

    def append_now(self, submission: DuplexStageSubmission) -> bool:
        """A resident request's appends after its first are taken at once: hearing,
        detecting and listening only queue work, so nothing here waits (rule 5)."""
        if submission.context.request_id not in self._resident_submitted:
            return False
        self._append(submission)
        return True

    def prepare_turn(self, turn: DuplexPreparedTurn) -> None:
        """Start `turn` with its outputs held (rule 4); it replaces the session's
        previous prepared turn. A turn `submit` would refuse is not prepared."""
        self.discard_prepared(turn.session_id)
        try:
            check_params(turn.sampling_params)
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
        work = Turn(turn.session_id, ids, {}, request, turn.sampling_params, held=[])
        work.utterance = self._claim(turn.session_id, request)
        self._prepared[turn.session_id] = _Prepared(turn, work)
        self._launch(work)

    def discard_prepared(self, session_id: str) -> None:
        prepared = self._prepared.pop(session_id, None)
        if prepared is not None:
            self.prepare_stats["discarded"] += 1
            self._runner.stop(prepared.turn)

    async def abort_requests(self, request_ids: list[str]) -> None:
        listening = self._stop_listening(request_ids)
        turns = self._close(request_ids)
        for turn in turns:
            self._runner.stop(turn)
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
                self._drop_listener(context.session_id)

    def close_session(self, session_id: str) -> None:
        """The session is over (closed, dropped or drained): free everything kept for it,
        its live input and the LLM's cached context included."""
        self.discard_prepared(session_id)
        self._sessions.pop(session_id, None)
        self._drop_listener(session_id)
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

    async def input_room(self, session_id: str) -> None:
        """Return once the session's audio not yet through the VAD is within bounds."""
        listener = self._listeners.get(session_id)
        if listener is not None:
            await listener.room()

    def _drop_listener(self, session_id: str) -> None:
        listener = self._listeners.pop(session_id, None)
        if listener is not None:
            listener.close()

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
            emit_speech=lambda rid, decision: self._emit(
                DuplexStageOutput(
                    session_id=session_id,
                    request_id=rid,
                    stage_id=0,
                    kind="speech",
                    metadata=decision.as_metadata(),
                )
            ),
        )

    def _emit(self, out: DuplexStageOutput) -> None:
        sink = self._runner.sink
        if sink is not None:
            sink(out)

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
        self._emit(
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
        self._check(request, params[ASR], params[TTS])
        return request

    def _start_turn(
        self, context: DuplexStageRequestContext, request: TurnRequest, params: tuple[Any, ...]
    ) -> Turn:
        fence: DuplexFence = context.fence
        ids = {
            stage: duplex_ephemeral_stage_request_id(fence, stage_id=stage)
            for stage in range(context.stage_id, context.final_stage_id + 1)
        }
        turn = Turn(context.session_id, ids, dict(ids), request, params)
        turn.utterance = self._claim(context.session_id, request)
        self._register(turn)
        self._launch(turn)
        return turn

    def _register(self, turn: Turn) -> None:
        for rid in turn.out_ids.values():
            self._turns[rid] = turn
            self._runner.open_ids.add(rid)

    def _launch(self, turn: Turn) -> None:
        if turn.request.cache_key is not None:
            self._cache_keys.setdefault(turn.session_id, set()).add(turn.request.cache_key)
        turn.task = self._runner.start(turn)
        turn.task.add_done_callback(lambda _: self._forget(turn))

    def _take_prepared(
        self, context: DuplexStageRequestContext, request: TurnRequest, params: tuple[Any, ...]
    ) -> Turn | None:
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
            self._runner.stop(turn)
            return None
        self.prepare_stats["adopted"] += 1
        return turn

    def _adopt(self, turn: Turn, context: DuplexStageRequestContext) -> None:
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
            self._runner.emit(turn, stage, kind, **fields)
        if turn.task is not None and turn.task.done():
            self._forget(turn)  # it finished while held: its done callback found no ids

    def _close(self, request_ids: list[str]) -> list[Turn]:
        """Close the ids and return their running turns (each once)."""
        turns: dict[int, Turn] = {}
        for rid in request_ids:
            self._runner.open_ids.discard(rid)
            turn = self._turns.get(rid)
            if turn is not None:
                turns[id(turn)] = turn
        return list(turns.values())

    async def _wait_stopped(self, turns: list[Turn]) -> None:
        current = asyncio.current_task()
        tasks = [t.task for t in turns if t.task is not None and t.task is not current]
        if tasks:
            await asyncio.wait(tasks)

    def _forget(self, turn: Turn) -> None:
        for rid in turn.out_ids.values():
            self._runner.open_ids.discard(rid)
            if self._turns.get(rid) is turn:
                del self._turns[rid]

    def _session_has_requests(self, session_id: str) -> bool:
        return any(c.session_id == session_id for c in self._reserved.values())

    def _check(self, request: TurnRequest, asr: AsrParams, tts: TtsParams) -> None:
        """Refuse audio over the ASR limit and a voice the TTS stage does not speak."""
        if request.audio_seconds > asr.max_audio_s:
            seconds = f"{request.audio_seconds:.1f} s; the limit is {asr.max_audio_s} s"
            raise ValueError(f"turn audio is {seconds}")
        voice = request.voice if request.voice is not None else tts.voice
        if request.final is TTS and voice not in self.voices:
            raise ValueError(f"unknown voice {voice!r}; this engine speaks {self.voices}")


def _is_resident(context: DuplexStageRequestContext) -> bool:
    """Whether `context` names its session's resident stage-0 request of its epoch."""
    return context.request_id == duplex_resource_request_id(context.fence, RESIDENT_ROLE)
