"""A session's speech detection, run by its resident stage-0 request (`engine.listening.listener`):
the engine's VAD stage gives speech probabilities per 32 ms chunk, a `SpeechDetector`
turns them into start/stop decisions (and, with `pause_after_ms`, the pauses that may
become a stop) on the session clock. The settings come as a `duplex.appends.Detect`, the
decisions go out as `duplex.events.SpeechDecision`s.

semantic_vad uses the same detector with the eagerness's longest wait as its silence:
when a silence reaches `semantic_words_after_ms`, the ASR stage transcribes the speech
before it (the pause that prepares the answer goes out with those words); at
`semantic_score_after_ms`, once those words are in, the engine's turn-end model scores
the speech heard so far (its last 8 s). The turn ends at the start of that silence if
the score is `semantic_complete_threshold` or more and the words do not stop on one
that cannot end an English sentence ("for", "the", "and"...).
The model hears prosody, the words catch what prosody misses (synthetic voices fool
the model both ways). Speech coming back first makes the decision moot.

The model scores a silence again every `semantic_rescore_ms`, each time only once the
previous score is in, so that scores never queue up behind a busy engine; the words
are transcribed once per silence (they cannot change while it lasts), and words that
stop mid-sentence end the scoring of that silence.

With `min_interruption_ms`, each speech also reports once that it is `confirmed` (heard
that long, or earlier once `WatchWords` asked for its words and they are more than a
backchannel); the gateway interrupts the assistant only then.

Each (re)configuration opens a fresh VAD stream and detector, so new settings apply from
the next appended audio and never to a half-detected utterance.

The VAD hears every appended sample, within bounds on the audio it has not heard yet
(`engine.listening.vad_feeder`). The audio the checks look back at is the listener's, the one copy
the engine keeps of the session's input (`clip`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from duplex.appends import Detect
from duplex.events import SpeechDecision
from engine.listening.speech_detector import (
    SpeechConfirmed,
    SpeechDetector,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
)
from engine.listening.turn_words import is_backchannel, sounds_unfinished, sounds_unsure
from engine.listening.vad_feeder import FeedProgress, VadEngine, VadFeeder
from engine.runtime.stage import StageOutput
from engine.stages.asr_request import AsrRequest, Transcription

__all__ = ["CANDIDATE_SILENCE_MS", "SAMPLES_PER_MS", "SpeechDetection"]

logger = logging.getLogger(__name__)

SAMPLES_PER_MS = 16
# How long a silence ends speech heard over a running answer (or its echo), in either
# mode, until it is a turn: server VAD's default silence.
CANDIDATE_SILENCE_MS = 500

# The audio between two times of the detection's stream (ms since it was configured).
Clip = Callable[[int, int], np.ndarray]
Emit = Callable[[SpeechDecision], None]


class SpeechDetection:
    """One session's speech detection (see the module docstring). `clip` gives the
    audio heard between two stream times, `emit` takes each decision in order."""

    def __init__(self, engine: VadEngine, session_id: str, clip: Clip, emit: Emit) -> None:
        self._engine = engine
        self._session_id = session_id
        self._clip = clip
        self._emit = emit
        self._scoring: set[asyncio.Task[None]] = set()
        self._serial = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._feeder = VadFeeder(engine)
        self._closed = False
        self._detect = Detect(enabled=False)
        self._watch_words = False  # the speech under way is a candidate interruption
        self._reopen = False  # its confirmation did not count: confirm it afresh
        # (silence start, silence length at which the turn is next scored)
        self._next_score: tuple[int, int] | None = None
        # (silence start, the transcript of the speech before it): the words do not
        # change while the silence lasts, so every scoring in it shares one transcript.
        self._silence_words: tuple[int, asyncio.Task[Any]] | None = None
        self._announced: int | None = None  # the silence whose pause went out with its words
        # The latest scoring: a silence is scored again only once it has answered, so
        # that scorings do not queue up (and take the CPU) while the engine is busy.
        self._turn_score: asyncio.Task[None] | None = None
        self._words_check: asyncio.Task[None] | None = None  # the latest interruption check

    @property
    def enabled(self) -> bool:
        return self._detect.enabled and not self._closed

    def configure(self, detect: Detect) -> None:
        """Start over with `detect` (a fresh VAD stream and detector, so new settings
        apply from the next fed audio), or stop (`detect.enabled` False)."""
        self._stop_stream()
        self._detect = detect
        if not detect.enabled or self._closed:
            return
        detector = SpeechDetector(
            threshold=detect.threshold,
            prefix_padding_ms=detect.prefix_padding_ms,
            silence_duration_ms=detect.silence_ms,
            pause_after_ms=detect.pause_after_ms,
            confirm_after_ms=detect.min_interruption_ms or None,
        )
        stream_id = f"{self._session_id}.vad{next(self._serial)}"
        progress = self._feeder.open(stream_id)
        outputs = self._engine.stream("vad", stream_id, None)
        reading = self._read(outputs, detector, detect.start_ms, progress)
        self._reader = asyncio.create_task(reading, name="vad-read")

    @property
    def scoring(self) -> bool:
        """Whether a turn-end scoring or a words check is still waiting for its answer."""
        return bool(self._scoring)

    def watch_words(self, again: bool = False) -> None:
        self._watch_words = True
        self._reopen = self._reopen or again

    def turn_taken(self) -> None:
        """The speech under way is the user's turn now (its utterance started): no
        candidate interruption any more, so it ends as a turn does, not at
        `CANDIDATE_SILENCE_MS`."""
        self._watch_words = self._reopen = False

    def feed(self, samples: np.ndarray) -> None:
        if self._feeder.stream_id is not None and samples.size:
            self._feeder.put(samples)

    async def room(self) -> None:
        await self._feeder.room()

    def close(self) -> None:
        """Stop detecting for good: nothing more is emitted; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_stream()
        self._feeder.close()

    def _stop_stream(self) -> None:
        for task in self._scoring:
            task.cancel()
        self._scoring.clear()
        self._forget_words()
        self._announced = None
        self._feeder.progress.close()
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._feeder.stream_id is not None:
            self._engine.abort("vad", self._feeder.stream_id)
            self._feeder.stream_id = None

    async def _read(
        self,
        outputs: AsyncIterator[StageOutput],
        detector: SpeechDetector,
        start_ms: float,
        progress: FeedProgress,
    ) -> None:
        try:
            await self._decide(outputs, detector, start_ms, progress)
        finally:
            progress.close()  # nothing more is heard: the feeder must not wait for it

    async def _decide(
        self,
        outputs: AsyncIterator[StageOutput],
        detector: SpeechDetector,
        start_ms: float,
        progress: FeedProgress,
    ) -> None:
        speech_start_ms = 0
        next_word_check_ms = self._detect.interruption_words_after_ms
        async for output in outputs:
            if output.error:
                logger.warning("VAD stream failed: %s", output.error)
                return
            probabilities = np.asarray(output.payload, dtype=np.float32)
            progress.hear(len(probabilities) * detector.chunk)
            for decision in detector.push(probabilities):
                if isinstance(decision, SpeechStarted):
                    speech_start_ms = decision.audio_start_ms
                    self._watch_words = self._reopen = False
                    event = SpeechDecision("started", start_ms + decision.audio_start_ms)
                elif isinstance(decision, SpeechConfirmed):
                    event = SpeechDecision("confirmed", start_ms + decision.audio_start_ms)
                elif isinstance(decision, SpeechPaused):
                    if self._pause_waits_for_words():
                        continue  # announced with the words (`_announce_pause`)
                    event = SpeechDecision("paused", start_ms + decision.audio_end_ms)
                elif isinstance(decision, SpeechResumed):
                    event = SpeechDecision("resumed", start_ms + decision.detected_ms)
                else:
                    event = SpeechDecision("stopped", start_ms + decision.audio_end_ms)
                self._emit(event)
            if self._reopen:
                self._reopen = False
                detector.reopen()
                next_word_check_ms = detector.heard_ms
            next_word_check_ms = self._check_words(detector, speech_start_ms, next_word_check_ms)
            if self._detect.semantic:
                self._follow_silence(detector, speech_start_ms, start_ms)

    def _follow_silence(
        self, detector: SpeechDetector, speech_start_ms: int, start_ms: float
    ) -> None:
        """semantic_vad: have the turn scored at `semantic_score_after_ms` into a silence
        and every `semantic_rescore_ms` after (or once the previous scoring answered, if
        that is later). Speech over a running answer (words watched) is no turn to
        score: it ends after server_vad's default silence, so a backchannel does not
        hold the detector for the eagerness's long wait."""
        silent_since = detector.silent_since_ms
        if silent_since is None:
            self._next_score = None
            self._forget_words()
            if self._turn_score is not None:
                self._turn_score.cancel()  # the speaker went on: its answer is moot
            return
        silence = detector.position_ms - silent_since
        if self._watch_words:
            if silence >= CANDIDATE_SILENCE_MS:
                stop = detector.end_silence()
                if stop is not None:
                    self._emit(SpeechDecision("stopped", start_ms + stop.audio_end_ms))
            return
        if silence >= self._detect.words_after_ms:
            self._ask_words(silent_since, speech_start_ms, detector)
        if self._next_score is None or self._next_score[0] != silent_since:
            self._next_score = (silent_since, self._detect.score_after_ms)
        if silence < self._next_score[1]:
            return
        if self._turn_score is not None and not self._turn_score.done():
            return  # one scoring at a time: the next once this one has answered
        words = self._words_of(silent_since)
        if words is not None and not words.done():
            # The words first: the answer is prepared from them, so they are on the way
            # to its first audio, and a score taken beside them would slow them down.
            return
        rescore = self._detect.rescore_ms
        self._next_score = (silent_since, self._next_score[1] + rescore if rescore else 10**9)
        clip = self._clip(speech_start_ms, detector.position_ms)
        self._score(clip, detector, silent_since, silence, start_ms)

    def _check_words(
        self, detector: SpeechDetector, speech_start_ms: int, due_ms: int | None
    ) -> int | None:
        """Transcribe the speech under way once it has been heard `due_ms`; returns when
        the next check is due (a new speech starts the count again)."""
        first = self._detect.interruption_words_after_ms
        every = self._detect.interruption_words_every_ms or first
        limit = self._detect.min_interruption_ms
        if first is None or every is None or due_ms is None:
            return due_ms
        if not detector.speaking:
            if self._words_check is not None:
                self._words_check.cancel()  # about a speech that is over
            return first
        if not self._watch_words or detector.confirmed:
            return due_ms  # no answer to interrupt, or it is interrupted already
        # Due by the time since the speech began, not by its voiced chunks: unvoiced
        # consonants ("excuse", "stop") held the first check back by up to 250 ms.
        if detector.heard_ms < due_ms or (limit and detector.voiced_ms >= limit):
            return due_ms
        if self._words_check is not None and not self._words_check.done():
            # One check at a time: on a busy engine, checks queued behind each other
            # would each answer later; the next one hears more speech instead.
            return due_ms
        clip = self._clip(speech_start_ms, detector.position_ms)
        request_id = f"{self._session_id}.words{next(self._serial)}"
        task = asyncio.create_task(
            self._confirm_if_meant(request_id, clip, detector, detector.speech_number),
            name="interruption-words",
        )
        self._scoring.add(task)
        task.add_done_callback(self._scoring.discard)
        self._words_check = task
        return max(due_ms + every, detector.heard_ms)

    async def _confirm_if_meant(
        self, request_id: str, clip: np.ndarray, detector: SpeechDetector, speech: int
    ) -> None:
        asked = time.monotonic()
        # Urgent: the answer this may cancel waits while the words are transcribed. Greedy:
        # they only tell words from a backchannel, and beams took 1.5 to 2 times as long.
        check = AsrRequest(clip, urgent=True, greedy=True)
        words = self._result("asr", request_id, check)
        try:
            heard: Transcription | None = await words
        finally:
            words.cancel()
        logger.debug(
            "words over the answer (%d ms) after %.0f ms: %r",
            len(clip) // SAMPLES_PER_MS,
            (time.monotonic() - asked) * 1000,
            heard and heard.text,
        )
        if heard is None or is_backchannel(heard.text):
            return
        if detector.speech_number == speech:
            confirmed = detector.confirm()
            if confirmed is not None:
                start = self._detect.start_ms + confirmed.audio_start_ms
                # The words go up with it: the gateway tells the answer's echo by them.
                self._emit(SpeechDecision("confirmed", start, heard.text))

    def _score(
        self,
        clip: np.ndarray,
        detector: SpeechDetector,
        silence_ms: int,
        silent_for_ms: int,
        start_ms: float,
    ) -> None:
        """Ask the turn-end model about the speech before the silence at `silence_ms`,
        heard `silent_for_ms` long so far."""
        request_id = f"{self._session_id}.turn{next(self._serial)}"
        scoring = self._end_if_complete(
            request_id, clip, detector, (silence_ms, silent_for_ms), start_ms
        )
        task = asyncio.create_task(scoring, name="turn-score")
        self._scoring.add(task)
        task.add_done_callback(self._scoring.discard)
        self._turn_score = task

    async def _end_if_complete(
        self,
        request_id: str,
        clip: np.ndarray,
        detector: SpeechDetector,
        silence: tuple[int, int],
        start_ms: float,
    ) -> None:
        silence_ms, silent_for_ms = silence
        asked = time.monotonic()
        score = self._result("turn", request_id, clip)
        words = self._words_of(silence_ms)  # asked for before the score
        heard: Transcription | None = None
        try:
            probability = await score
            scored = time.monotonic()
            # Shielded: later scorings in the same silence read the same transcript.
            heard = await asyncio.shield(words) if words is not None else None
        finally:  # a stream closed meanwhile cancels this task: stop the scoring too
            score.cancel()
        logger.debug(
            "turn end at %d ms: complete %.3f after %.0f ms, words %r (ending %s) after %.0f ms",
            silence_ms,
            probability or 0.0,
            (scored - asked) * 1000,
            heard and heard.text,
            heard and [round(p, 2) for p in heard.logprobs[-3:]],
            (time.monotonic() - asked) * 1000,
        )
        if words is not None:
            self._announce_pause(silence_ms, heard, detector)  # before a stop it may send
        if words is not None and (heard is None or sounds_unfinished(heard.text)):
            self._stop_scoring(silence_ms)
            return  # the words will not change in this silence: it lasts to the cap
        unsure = heard is not None and sounds_unsure(heard.text, heard.logprobs)
        if unsure and silent_for_ms < self._detect.unsure_wait_ms:
            # Maybe a cut phrase whisper completed: the speaker gets time to go on.
            self._score_again_at(silence_ms, self._detect.unsure_wait_ms)
            return
        if probability is None or probability < self._detect.complete_threshold:
            return  # incomplete: the detector ends the turn at the eagerness's longest wait
        if detector.silent_since_ms != silence_ms:
            return  # the speaker went on (or the turn already ended)
        stop: SpeechStopped | None = detector.end_silence()
        if stop is not None:
            self._emit(SpeechDecision("stopped", start_ms + stop.audio_end_ms))

    def _ask_words(self, silence_ms: int, speech_start_ms: int, detector: SpeechDetector) -> None:
        """Have the speech before the silence at `silence_ms` transcribed, once: the
        words do not change while the silence lasts, so its scorings share them."""
        if not self._detect.words or self._words_of(silence_ms) is not None:
            return
        self._forget_words()
        clip = self._clip(speech_start_ms, detector.position_ms)
        request_id = f"{self._session_id}.turnwords{next(self._serial)}"
        request = AsrRequest(clip, logprobs=True)  # how sure it is of the end
        words = self._result("asr", request_id, request)
        words.add_done_callback(
            lambda done: self._words_in(done, silence_ms, detector, speech_start_ms)
        )
        self._silence_words = (silence_ms, words)

    def _words_of(self, silence_ms: int) -> asyncio.Task[Any] | None:
        """The transcript asked for the silence at `silence_ms` (None: not asked for)."""
        words = self._silence_words
        return words[1] if words is not None and words[0] == silence_ms else None

    def _pause_waits_for_words(self) -> bool:
        """semantic_vad transcribes the speech before each silence it scores: the pause
        is announced once those words are in, with them, so that the answer prepared in
        the silence starts from them and does not transcribe the same speech again."""
        return self._detect.semantic and self._detect.words and not self._watch_words

    def _words_in(
        self,
        words: asyncio.Task[Any],
        silence_ms: int,
        detector: SpeechDetector,
        speech_start_ms: int,
    ) -> None:
        if words.cancelled() or self._words_of(silence_ms) is not words:
            return  # the stream it was asked for closed since (a done task ignores cancel)
        self._announce_pause(silence_ms, None if words.exception() else words.result(), detector)
        if detector.silent_since_ms == silence_ms:  # a score that waited for them is due
            self._follow_silence(detector, speech_start_ms, self._detect.start_ms)

    def _announce_pause(
        self, silence_ms: int, heard: Transcription | None, detector: SpeechDetector
    ) -> None:
        """The pause at `silence_ms` with its words, once, while the silence lasts."""
        if self._announced == silence_ms or detector.silent_since_ms != silence_ms:
            return
        self._announced = silence_ms
        text = heard.text if heard is not None else None
        logger.debug(
            "pause at %d ms: %d ms of silence heard, words %r",
            silence_ms,
            detector.position_ms - silence_ms,
            text,
        )
        self._emit(SpeechDecision("paused", self._detect.start_ms + silence_ms, words=text))

    def _forget_words(self) -> None:
        if self._silence_words is not None:
            self._silence_words[1].cancel()
            self._silence_words = None

    def _score_again_at(self, silence_ms: int, silent_for_ms: int) -> None:
        """Score the silence at `silence_ms` next once it has lasted `silent_for_ms`."""
        if self._next_score is not None and self._next_score[0] == silence_ms:
            self._next_score = (silence_ms, max(self._next_score[1], silent_for_ms))

    def _stop_scoring(self, silence_ms: int) -> None:
        """No more scorings in the silence at `silence_ms`: it lasts to the eagerness's
        longest wait (or until speech comes back)."""
        if self._next_score is not None and self._next_score[0] == silence_ms:
            self._next_score = (silence_ms, 10**9)

    def _result(
        self, stage: str, request_id: str, inputs: np.ndarray | AsrRequest
    ) -> asyncio.Task[Any]:
        """The one output of a request on `stage`, as a task (None if it failed)."""

        async def run() -> Any:
            result = None
            try:
                async for output in self._engine.stream(stage, request_id, inputs):
                    if output.error:
                        logger.warning("%s for the turn end failed: %s", stage, output.error)
                        return None
                    result = output.payload
            finally:
                self._engine.abort(stage, request_id)
            return result

        return asyncio.create_task(run(), name=f"turn-{stage}")
