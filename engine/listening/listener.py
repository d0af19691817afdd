"""The engine side of a session's resident stage-0 request: what it has heard, its
speech detection, the utterance being spoken, and that utterance's live transcript.

Rules of this module:
1. A `Listener` belongs to one session. The audio it heard, its clock (samples heard)
   and the utterance being spoken are the session's input and outlive epochs; the live
   work belongs to the epoch's resident request: `stop()` (the request aborted) ends it
   at once, and nothing is emitted after it, because emission goes through
   `resident_id`. The next epoch's resident request `attach`es and the live work of an
   utterance still spoken goes on under it, so a cancel in mid-utterance loses no word.
2. Memory is bounded: without an utterance only `LOOKBACK_S` of audio is kept (speech
   starts are reported late: VAD's window and the audio it has not heard yet, a
   confirmed interruption's minimum length); an utterance keeps its own audio, up to the
   ASR limit, past which its live work ends. This is the one copy of the session's input
   the engine keeps: speech detection looks back at it too.
3. While listening, one task per utterance runs a partial transcription whenever
   `interval_ms` more audio has arrived (half that in the utterance's first
   `EARLY_S`, so its first words show sooner) and none of its partials is running,
   over its audio up to the newest point of that grid heard (so the same speech gets
   the same partials whenever the engine keeps up); each
   partial's newly agreed words (LocalAgreement, inside `LiveTranscript`) go out as one
   `transcript_delta`, so deltas are only ever appended. The first delta's leading
   blank is dropped, as a transcript's is.
4. A turn that names the utterance claims it (`claim`): its partials stop (one in
   flight is dropped unagreed) and the turn finishes the live transcript over the
   turn's own audio, its final request freezing it. A turn that stops before its
   transcript went out (a prepared turn dropped, a transcription superseded) gives it
   back (`release`): it is thawed, live again while still spoken, and the next turn
   naming it finishes it, so the final transcript always begins with the deltas sent.
5. Every heard sample goes to speech detection (`engine.listening.speech_detection`) while a
   `Detect` append has it on. Its decisions are the session's, like the audio, and
   outlive epochs: each goes out on the resident id of its moment, and one decided while
   no resident request is attached (between an epoch's abort and the next one's first
   append) waits for the next `attach`, so none is lost.
6. Each utterance is transcribed once, and its words travel one way: up. Words the
   detection heard for a pause (`paused`, while the session does not listen) are kept on
   the utterance under way and go up with the decision; a turn that names the utterance
   and ends at that pause reports them as its transcript instead of transcribing the
   same speech again. Speech that resumes, or stops elsewhere, drops them.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from duplex.appends import (
    Append,
    Detect,
    Heard,
    Listen,
    UtteranceEnded,
    UtteranceStarted,
    WatchWords,
)
from duplex.events import SpeechDecision
from engine.listening.speech_detection import SAMPLES_PER_MS, SpeechDetection
from engine.listening.vad_feeder import MAX_UNHEARD_SAMPLES
from engine.runtime import clients
from engine.runtime.core import AsyncEngine

__all__ = ["LOOKBACK_S", "Listener", "LiveDelta", "LiveTranscript", "Utterance", "final_text"]

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
# The turn-end model's 8 s window, after all the audio the VAD may not have heard yet.
LOOKBACK_S = 8.0 + MAX_UNHEARD_SAMPLES / SAMPLE_RATE
# The start of an utterance is transcribed twice as often: two partials must agree
# before a word shows, and the first words are the ones a caption waits for.
EARLY_S = 1.5

Emit = Callable[[str, str, str, tuple[tuple[str, float], ...]], None]
EmitSpeech = Callable[[str, SpeechDecision], None]


class LiveDelta(Protocol):
    """Newly committed words and their `(token, logprob)` pairs."""

    @property
    def text(self) -> str: ...

    @property
    def tokens(self) -> tuple[tuple[str, float], ...]: ...


class LiveTranscript(Protocol):
    """One utterance's incremental transcription (the ASR stage makes them)."""

    @property
    def counts_from_s(self) -> float: ...

    def request(self, audio: np.ndarray, *, final: bool) -> Any: ...

    def agree(self, result: Any) -> LiveDelta | None: ...

    def finish(self, result: Any) -> LiveDelta: ...

    def thaw(self) -> None: ...


@dataclass(eq=False)
class Utterance:
    """The speech under way: where it started, and what has gone out of it live."""

    utterance_id: str
    start: int  # sample on the session clock
    live: LiveTranscript | None = None
    committed: str = ""  # the agreed words so far: the deltas' texts, concatenated
    tokens: list[tuple[str, float]] = field(default_factory=list)
    claimed: bool = False
    partial_at: int = 0  # the clock when its last partial was asked for
    # What the detection heard up to a pause in it: (pause's session ms, words); rule 6.
    paused: tuple[float, str] | None = None

    @property
    def words(self) -> str | None:
        """The detection's words for the whole utterance, if it ended at their pause."""
        return None if self.paused is None else self.paused[1]


def final_text(committed: str, tail: str) -> str:
    """The whole transcript: what went out live, then the tail, with no outer blanks
    except where cutting one would change what went out."""
    text = committed + tail if committed else tail.lstrip()
    trimmed = text.rstrip()
    return trimmed if len(trimmed) >= len(committed) else text


class HeardAudio:
    """The session's recent input, on its clock (rule 2)."""

    def __init__(self) -> None:
        self._chunks: collections.deque[np.ndarray] = collections.deque()
        self.start = 0  # the clock at the first sample kept
        self.end = 0  # samples heard

    def append(self, samples: np.ndarray) -> None:
        self._chunks.append(samples)
        self.end += len(samples)

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in list(self._chunks))

    def skip_to(self, clock: int) -> None:
        """Samples up to `clock` went unheard: what is kept is from before them."""
        if clock > self.end:
            self._chunks.clear()
            self.start = self.end = clock

    def keep_from(self, sample: int) -> None:
        while self._chunks and self.start + len(self._chunks[0]) <= sample:
            self.start += len(self._chunks.popleft())

    def since(self, sample: int) -> np.ndarray:
        return self.between(sample, self.end)

    def between(self, first: int, end: int) -> np.ndarray:
        """The samples kept from clock `first` up to clock `end`."""
        pieces, at = [], self.start
        for chunk in self._chunks:
            if at >= end:
                break
            if at + len(chunk) > first:
                pieces.append(chunk[max(first - at, 0) : end - at])
            at += len(chunk)
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


class Listener:
    """One session's live listening (see the module rules)."""

    def __init__(
        self,
        session_id: str,
        engine: AsyncEngine,
        *,
        interval_ms: int,
        max_audio_s: float,
        emit: Emit,
        emit_speech: EmitSpeech,
    ) -> None:
        self.session_id = session_id
        self.resident_id: str | None = None  # where deltas go; None: nowhere (rule 1)
        self.options: Listen | None = None
        self.heard = HeardAudio()
        self.utterance: Utterance | None = None
        # An utterance over whose turn stopped unfinished, for the turn that takes over.
        self._released: Utterance | None = None
        self._engine = engine
        self._interval = interval_ms * SAMPLE_RATE // 1000
        self._max_samples = int(max_audio_s * SAMPLE_RATE)
        self._emit = emit
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._serial = itertools.count()
        self._emit_speech = emit_speech
        self.speech = SpeechDetection(engine, session_id, self._clip, self._decided)
        self._origin = 0  # the clock where the detection's stream time starts
        self._held: list[SpeechDecision] = []  # decided while detached (rule 5)

    # -- appends ------------------------------------------------------------------------

    def apply(self, append: Append) -> None:
        match append:
            case Heard():
                self.hear(np.frombuffer(append.audio, dtype="<f4"))
            case UtteranceStarted(utterance_id, start_ms):
                self.start_utterance(utterance_id, start_ms)
            case UtteranceEnded(utterance_id):
                self.end_utterance(utterance_id)
            case Listen():
                self.listen(append)
            case Detect():
                self.detect(append)
            case WatchWords(again):
                self.speech.watch_words(again)

    def hear(self, samples: np.ndarray) -> None:
        self.heard.append(samples)
        if self.speech.enabled:
            self.speech.feed(samples)
        utterance = self.utterance
        if utterance is None:
            self.heard.keep_from(self.heard.end - int(LOOKBACK_S * SAMPLE_RATE))
            return
        if self.heard.end - utterance.start > self._max_samples:
            self._stop_partials()  # rule 2: too long to transcribe live
            self.heard.keep_from(self.heard.end - self._max_samples)
            return
        self.heard.keep_from(utterance.start)
        if self._task is not None and self._partial_end(utterance) is not None:
            self._wake.set()

    def start_utterance(self, utterance_id: str, start_ms: float) -> None:
        self._stop_partials()
        start = min(max(round(start_ms * SAMPLE_RATE / 1000), self.heard.start), self.heard.end)
        self.utterance = Utterance(utterance_id, start, partial_at=start)
        self.speech.turn_taken()
        self._start_partials()

    def end_utterance(self, utterance_id: str) -> None:
        if self.utterance is not None and self.utterance.utterance_id == utterance_id:
            self._stop_partials()
            self.utterance = None

    def listen(self, options: Listen) -> None:
        # What the session did not send while it did not listen still counts on the
        # clock, so that utterance starts fall where they were spoken.
        self.heard.skip_to(options.clock)
        self.options = options if options.enabled else None
        if self.options is None:
            self._stop_partials()

    def detect(self, detect: Detect) -> None:
        self.heard.skip_to(detect.clock)
        self._origin = detect.clock
        self.speech.configure(detect)

    async def room(self) -> None:
        """Return once the audio heard and not yet through the VAD is within bounds."""
        await self.speech.room()

    def close(self) -> None:
        """The session is over: its detection and live work end, nothing more goes out."""
        self.speech.close()
        self.stop()

    def _clip(self, start_ms: int, end_ms: int) -> np.ndarray:
        origin = self._origin
        return self.heard.between(
            origin + start_ms * SAMPLES_PER_MS, origin + end_ms * SAMPLES_PER_MS
        )

    def _decided(self, decision: SpeechDecision) -> None:
        self._keep_words(decision)
        if self.resident_id is None:
            self._held.append(decision)
        else:
            self._emit_speech(self.resident_id, decision)

    def _keep_words(self, decision: SpeechDecision) -> None:
        """Rule 6: the detection's words stand for the utterance while it ends where they
        were heard."""
        utterance = self.utterance
        if utterance is None:
            return
        match decision.kind:
            case "paused" if decision.words is not None and self.options is None:
                utterance.paused = (decision.ms, decision.words)
            case "stopped" if utterance.paused is not None and utterance.paused[0] == decision.ms:
                pass
            case "paused" | "resumed" | "stopped" | "started":
                utterance.paused = None

    # -- turns (rule 4) -----------------------------------------------------------------

    def claim(self, utterance_id: str | None) -> Utterance | None:
        """The utterance a turn finishes, if it is the one under way and unclaimed."""
        utterance = self.utterance
        if utterance is None or utterance.utterance_id != utterance_id:
            utterance, self._released = self._released, None
        if utterance is None or utterance.utterance_id != utterance_id or utterance.claimed:
            return None
        utterance.claimed = True
        # No partial result of it is agreed from now on: its final request (the turn's)
        # freezes the live transcript, and `release` thaws it.
        self._stop_partials()
        return utterance

    def release(self, utterance: Utterance) -> None:
        """A turn that claimed `utterance` stopped before its transcript went out (a
        prepared turn dropped, a transcription superseded): the next turn naming it
        finishes it instead, and while it is still spoken it is live again."""
        if not utterance.claimed:
            return
        utterance.claimed = False
        if utterance.live is not None:
            utterance.live.thaw()
        if utterance is self.utterance:
            self._start_partials()
        else:
            self._released = utterance

    # -- the resident request's end (rule 1) --------------------------------------------

    def attach(self, resident_id: str) -> None:
        """The epoch's resident request opened: live work goes on under its id."""
        self.resident_id = resident_id
        held, self._held = self._held, []
        for decision in held:
            self._emit_speech(resident_id, decision)
        self._start_partials()

    def stop(self) -> asyncio.Task[None] | None:
        """The resident request was aborted: its live work ends now. Returns the task
        to wait for, if one was running."""
        self.resident_id = None
        task = self._task
        self._stop_partials()
        return task

    # -- partials (rule 3) --------------------------------------------------------------

    def _start_partials(self) -> None:
        utterance = self.utterance
        if self.options is None or utterance is None or utterance.claimed or self._task:
            return
        if self.resident_id is None:
            return  # words agreed now could not go out: wait for the next `attach`
        self._wake.clear()
        self._task = asyncio.create_task(
            self._partials(utterance, self.options), name=f"live {utterance.utterance_id}"
        )

    def _stop_partials(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _partials(self, utterance: Utterance, options: Listen) -> None:
        try:
            await self._run_partials(utterance, options)
        except asyncio.CancelledError:
            raise
        except Exception:  # live captions are a bonus: the turn still transcribes it all
            logger.exception("live transcription of %s stopped", utterance.utterance_id)

    async def _run_partials(self, utterance: Utterance, options: Listen) -> None:
        if utterance.live is None:
            utterance.live = await self._new_live(options)
        live = utterance.live
        while True:
            while (end := self._partial_end(utterance)) is None:
                await self._wake.wait()
                self._wake.clear()
            utterance.partial_at = end
            audio = self.heard.between(utterance.start, end)
            result = await self._transcribe(live.request(audio, final=False))
            delta = live.agree(result) if result is not None else None
            if delta is not None:
                self._send(utterance, delta, options)

    async def _new_live(self, options: Listen) -> LiveTranscript:
        return await clients.asr(self._engine).run(
            lambda asr: asr.new_live_transcript(options.prompt, options.logprobs)
        )

    def _partial_end(self, utterance: Utterance) -> int | None:
        """Where the next partial of `utterance` ends: the newest point heard of its grid
        (every interval from its start, half intervals in its first `EARLY_S`); None
        while none is new. A grid, not the newest sample heard, so that the same speech
        gets the same partials, and so the same transcript, whenever the engine keeps
        up, however its frames were batched on the way."""
        early = utterance.partial_at - utterance.start < EARLY_S * SAMPLE_RATE
        interval = self._interval // 2 if early else self._interval
        steps = (self.heard.end - utterance.partial_at) // interval
        end = utterance.partial_at + steps * interval
        if not steps:
            return None
        if (
            utterance.live is not None
            and end - utterance.start < utterance.live.counts_from_s * SAMPLE_RATE
        ):
            return None  # its guess would count for nothing
        return end

    async def _transcribe(self, request: Any) -> Any:
        rid = f"live.{self.session_id}.{next(self._serial)}"
        async for out in self._engine.stream("asr", rid, request):
            if out.error is not None:
                logger.warning("live transcription of %s failed: %s", self.session_id, out.error)
                return None
            if out.finished:
                return out.payload
        return None

    def _send(self, utterance: Utterance, delta: LiveDelta, options: Listen) -> None:
        text = delta.text if utterance.committed else delta.text.lstrip()
        utterance.tokens += delta.tokens
        utterance.committed += text  # the live transcript has committed it either way
        if text and self.resident_id is not None:
            logprobs = tuple(delta.tokens) if options.logprobs else ()
            self._emit(self.resident_id, utterance.utterance_id, text, logprobs)
