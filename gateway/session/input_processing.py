"""A session's input audio cleaned before anything hears it: WebRTC's audio processing
module (AEC3 echo canceller, noise suppression, high-pass filter) from the `livekit`
wheel.

Rules of this module:

1. It sits on the one input path, after the resampler to 16 kHz (`gateway.session.input_buffer`)
   and before voice activity, turn detection, speech-to-text and the committed item's
   samples: the detectors hear what is left after cancellation. The wire bytes stay as
   the client sent them.
2. The echo canceller's far-end reference is `FarEnd`: the audio the client plays, on the
   session clock. Each 10 ms near-end frame at clock position `p` is processed right
   after the far-end frame at `p`; the echo comes later than that by the network, the
   device buffers and the room, a delay AEC3 estimates and follows as it drifts.
3. Clean input loses nothing: with no noise suppression asked for, frames pass untouched
   while no far-end audio played within `ECHO_TAIL_MS` before them, so speech on an
   echo-free session (headphones, text output, a silent assistant) is the client's own.
4. Like the resampler, it is a stream: it holds back a partial frame until more input
   (or `last=True`, which pads the frame, processes it and returns only the real part).
   `restart(at_ms)` puts its next input at `at_ms` of the session clock.
5. AEC3 starts out unsure whether the far end comes back at all, and while it is unsure
   it suppresses near-end speech over far-end audio: for the first 5 to 7 s of far-end
   audio a headset user (or a browser that cancelled its own echo) who talks over an
   answer would be cut. So before its first far-end frame the module hears `WARM_S` of
   a synthetic far end over a silent microphone: it starts as it would on a headset,
   passing near-end speech, and the first echo of a speakerphone makes it cancel.
6. While the echo canceller runs, the module keeps the last `HISTORY_S` of the raw
   microphone, of the far end it was given and of what it made of the microphone:
   `heard_echo` tells from them whether speech heard over an answer is that answer's
   echo. The echo the canceller lets through while it learns the room is explained by
   the far end (`gateway.session.double_talk`); once it has learnt the room, what is left of the
   echo is far below what the microphone picked up (`CANCELLED_DB`), while a person's
   voice comes through within a few dB. And the words that confirmed the speech may be
   the answer's own (`is_echo`): then it is the echo, whatever the energy says. Where
   the microphone heard the echo alone before the span a check looks at, that stretch
   (up to `LEARNT_MS`) teaches how loud the room's echo is (`double_talk.Coupling`,
   kept for the speech once learnt): speech `PERSON_EXCESS_DB` or more above that echo
   is a person, speech not above it (`ECHO_EXCESS_DB`) is the echo.
7. AEC3 costs Whisper words even where there is no echo: on a headset, speech over a
   playing answer came out of it within 1 dB of its level, yet transcribed with twice
   the word errors (bench/RESULTS.md, "Clean speech through the canceller"). So until
   the microphone is heard to carry the far end's echo, the canceller runs (it learns
   the room) but what it makes is not passed on: the detectors hear the microphone as
   it came. The echo is heard either way rule 6 tells it (a confirmation `heard_echo`
   finds to be echo), or when in `COUPLING_WINDOWS` windows in a row, each of
   `COUPLING_WINDOW_MS` of far-end audio, the canceller took `CANCELLED_DB` or more off
   a microphone that heard something; from then on, for the rest of the session, the
   detectors hear the canceller's output.
8. Processing runs on the caller's thread: about 15 ms of CPU per second of audio while
   the canceller is active (bench/echo.py measures it), none while it passes frames on.
   The echo canceller's module (about 0.4 MiB) is made when the session's first spoken
   response starts (`FarEnd.expected`), well before its audio plays, and warmed up
   (50 to 90 ms of CPU, once) on a worker thread so as not to hold up the event loop;
   the module is used again only once the warm-up is done.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from gateway.protocol.audio import ENGINE_RATE, Samples
from gateway.server.priority import lower_this_thread
from gateway.session.double_talk import ECHO_SHARE, MAX_DELAY, Coupling, echo_share, energy
from gateway.session.far_end import FarEnd

if TYPE_CHECKING:  # livekit's library starts threads of its own: loaded only when used
    from livekit.rtc import AudioFrame, AudioProcessingModule

__all__ = [
    "CANCELLED_DB",
    "CHECKED_MS",
    "COUPLING_WINDOW_MS",
    "COUPLING_WINDOWS",
    "ECHO_TAIL_MS",
    "PARTLY_CANCELLED_DB",
    "PARTLY_ECHO_SHARE",
    "FRAME",
    "HISTORY_S",
    "LEARNT_MS",
    "PERSON_EXCESS_DB",
    "WARM_S",
    "InputProcessing",
    "NoiseReduction",
    "is_echo",
    "start_runtime",
]

logger = logging.getLogger(__name__)

FRAME = ENGINE_RATE // 100  # the module's 10 ms frame, in samples
# How long after the far end's last played sample its echo may still arrive: the
# longest delay AEC3 follows plus a reverberation tail.
ECHO_TAIL_MS = 1500
_TAIL = ECHO_TAIL_MS * ENGINE_RATE // 1000
WARM_S = 6  # rule 5
HISTORY_S = 4  # rule 6: a check's second, the `LEARNT_MS` before it and the far end's delay
CHECKED_MS = 1000  # the most recent speech `heard_echo` looks at
COUPLING_WINDOW_MS = 500  # rule 7: the span over which the canceller's work is weighed
_COUPLING_WINDOW = COUPLING_WINDOW_MS * ENGINE_RATE // 1000
# Rule 7: this many windows in a row. An echo lasts as long as the answer plays; on a
# headset, AEC3's suppressor once took 17.9 dB off a quiet window (-50.8 dBFS: a
# person's speech starting over the answer, `bench/echo.py`'s clean clips), once.
COUPLING_WINDOWS = 2
# Rule 7: a microphone quieter than this (RMS, -55 dBFS) heard nothing but its noise.
_HEARD_SOMETHING = (10 ** (-55 / 20)) ** 2
# Speech the canceller took this much off is the echo: a person talking over the echo
# kept their level within 4.5 dB in every room of `bench/echo.py --offline`.
CANCELLED_DB = 10.0
# ... or at least this share and this much taken off (`bench/echo.py` heard the echo
# of a hall and a kiosk at 0.44 and 0.49 with 3.3 and 8.7 dB, persons over the echo at
# 0.00 to 0.13 with 0.2 to 3.6 dB).
PARTLY_ECHO_SHARE = 0.3
PARTLY_CANCELLED_DB = 3.0
# The answer's words are its echo only where the microphone holds some of its sound: a
# person on a headset (no echo at all: 0.01 and 0.3 dB in the WebRTC browser test) may
# say a word the answer just said ("Stop. What is..." over "what a day"). The echo
# whose words were heard scored 0.34 and more live.
ANSWER_HEARD_SHARE = 0.15
# Rule 6: the echo before a check's span that the room's coupling is learnt on, at most
# (the history holds a check's second and this much before it).
LEARNT_MS = 2000
# A person adds this much or more to the echo the learnt coupling expects. Live, the
# echo alone came within 1.3 dB of it, and persons up to 18 dB above it
# (`bench/echo.py`'s rooms and `tests/test_echo_real.py`'s speakerphone; bench/RESULTS.md,
# "How loud the room's echo is").
PERSON_EXCESS_DB = 3.0
# ... and speech no louder than that echo adds nothing to it: the echo, whatever the
# share and the cancellation say (a kiosk's echo, while AEC3 had not yet learnt the
# room, came 0.4 to 0.7 dB under it with 0.46 of it explained and 1.1 dB taken off).
ECHO_EXCESS_DB = 0.0
_WARM_LEVEL = 0.05  # the synthetic far end's RMS (-26 dBFS), about a voice's level
_INT16 = 32767.0
_NO_SAMPLES: Samples = np.zeros(0, np.float32)
# Rule 8: one thread warms every session's module up, one after the other.
_WARM_UPS = ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="echo-warm-up", initializer=lower_this_thread
)


def is_echo(
    share: float, cancelled_db: float, answer_said: bool, excess_db: float | None = None
) -> bool:
    """Rule 6's verdict on speech over an answer: the share of the microphone's energy
    the far end explains (`double_talk.echo_share`), how much the canceller took off,
    whether its words were the answer's own, and how far it lay above the echo the
    room's learnt coupling expects (None: no coupling learnt)."""
    if answer_said and share >= ANSWER_HEARD_SHARE:
        # However little of it the far end explains (a reverberant hall's echo). Words
        # that are not the answer's prove nothing: Whisper garbles the echo's residue
        # ("Girl not me") as it garbles a person talking over it.
        return True
    if excess_db is not None and excess_db >= PERSON_EXCESS_DB:
        # Louder than the room makes the far end: a person. The share and the
        # cancellation blur where the person pauses and where AEC3's suppressor takes
        # them down with the echo (persons over a speakerphone's echo scored shares up
        # to 0.63 and up to 15 dB cancelled); the room's loudness does not.
        return False
    if excess_db is not None and excess_db <= ECHO_EXCESS_DB:
        return True
    # Partly the far end's, and much of it taken off: two weak signs that agree.
    partly = share >= PARTLY_ECHO_SHARE and cancelled_db >= PARTLY_CANCELLED_DB
    return share >= ECHO_SHARE or cancelled_db >= CANCELLED_DB or partly


def start_runtime() -> None:
    """Start the `livekit` library's runtime (five threads of its own, made on its first
    use) now: the CLI does it before it lowers every thread but the event loop's
    (`gateway.server.priority`), so that these run below the loop too."""
    _module(True, None)


@dataclass(frozen=True)
class NoiseReduction:
    """OpenAI's `noise_reduction`: `near_field` (a headset or a phone held to the ear),
    `far_field` (a laptop or a conference room microphone)."""

    type: Literal["near_field", "far_field"]


class InputProcessing:
    """The processing of one session's 16 kHz input stream, from session time `start_ms`."""

    def __init__(
        self,
        far_end: FarEnd,
        *,
        echo_cancellation: bool,
        noise_reduction: NoiseReduction | None,
        start_ms: float,
    ) -> None:
        self._far_end = far_end
        self._echo = echo_cancellation
        self._noise = noise_reduction
        self._apm = _module_now(echo_cancellation, noise_reduction)
        self._warm = False  # the module's warm-up has started (rule 5)
        self._warming: Future[None] | None = None  # ...and runs on a worker (rule 8)
        self._held: Samples = _NO_SAMPLES
        self._next = round(start_ms * ENGINE_RATE / 1000)  # clock index of the next frame
        self._heard = _History()  # rule 6: the raw microphone...
        self._played = _History()  # ...the far end it was given...
        self._cleaned = _History()  # ...and what it made of the microphone
        self.frames_processed = 0  # frames that went through the module (rule 5)
        self.echo_heard = False  # rule 7: the microphone carries the far end's echo
        self._weighed = _Weighing()  # rule 7: the current window's energy, in and out
        self._coupled_windows = 0  # rule 7: windows in a row the canceller took it off
        self._learnt: tuple[int, Coupling | None] | None = None  # rule 6: (speech, coupling)

    def configure(self, *, echo_cancellation: bool, noise_reduction: NoiseReduction | None) -> None:
        """New settings: a fresh module if they changed (the held frame is kept)."""
        if (echo_cancellation, noise_reduction) != (self._echo, self._noise):
            self._echo, self._noise = echo_cancellation, noise_reduction
            self._apm = _module_now(echo_cancellation, noise_reduction)
            self._warm, self._warming = False, None

    def push(self, samples: Samples, last: bool = False) -> Samples:
        """The processed samples that are complete so far, in order (rule 4)."""
        idle = self._idle()
        if self._far_end.expected or not idle:
            self._start_warm_up()
        if self._apm is None or idle:
            # Nothing to do: pass everything on, keeping the clock position.
            audio = np.concatenate([self._held, samples]) if self._held.size else samples
            self._held = _NO_SAMPLES
            self._next += len(audio)
            self._far_end.forget_before(self._next)
            return audio
        audio = np.concatenate([self._held, samples]) if self._held.size else samples
        whole = len(audio) // FRAME * FRAME
        if last and whole < len(audio):
            whole += FRAME
            audio = np.concatenate([audio, np.zeros(whole - len(audio), np.float32)])
            real = len(samples) + len(self._held)
        else:
            real = whole
        out = np.empty(whole, np.float32)
        for lo in range(0, whole, FRAME):
            out[lo : lo + FRAME] = self._frame(audio[lo : lo + FRAME])
        self._held = audio[whole:].copy() if not last else _NO_SAMPLES
        self._far_end.forget_before(self._next)
        return out[:real]

    def _idle(self) -> bool:
        """Rule 3 for the whole input from here on, until the far end plays again: no
        noise suppression, and the far end last played over `ECHO_TAIL_MS` ago (its
        history matters only from when it plays, `heard_echo` reads none before)."""
        return self._noise is None and not self._played_within_tail(self._next)

    def echo_may_arrive(self, at_ms: float) -> bool:
        """Whether the canceller is on and the far end played within `ECHO_TAIL_MS`
        before `at_ms` (or plays on): its echo may be in the microphone then."""
        at = round(at_ms * ENGINE_RATE / 1000)
        return self._echo and self._played_within_tail(at)

    def heard_echo(self, start_ms: float, end_ms: float, answer_said: bool = False) -> bool | None:
        """Whether the microphone from `start_ms` to `end_ms` (its last `CHECKED_MS` at
        most) heard the far end's echo rather than a person (rule 6); None if the
        canceller is off or heard none of that span while the far end played.
        `answer_said`: whether the words heard in it were the answer's own."""
        if not self._echo or self._apm is None:
            return None
        end = min(round(end_ms * ENGINE_RATE / 1000), self._next)
        start = max(round(start_ms * ENGINE_RATE / 1000), end - CHECKED_MS * ENGINE_RATE // 1000)
        start = max(start, self._heard.oldest, self._played.oldest + MAX_DELAY)
        if end <= start:
            return None
        far = self._played.read(start - MAX_DELAY, end - start + MAX_DELAY)
        if not far.any():
            return None
        mic = self._heard.read(start, end - start)
        cleaned = self._cleaned.read(start, end - start)
        cancelled_db = 10 * np.log10((energy(mic) + 1e-12) / (energy(cleaned) + 1e-12))
        share = echo_share(mic, far)
        coupling = self._coupling(round(start_ms * ENGINE_RATE / 1000), start)
        excess_db = None if coupling is None else coupling.excess_db(mic, far)
        logger.debug(
            "speech over the answer: %.2f echo, %.1f dB cancelled, %s dB above the echo "
            "in %d ms, the answer's words: %s",
            share,
            cancelled_db,
            "unknown" if excess_db is None else f"{excess_db:.1f}",
            (end - start) * 1000 // ENGINE_RATE,
            answer_said,
        )
        echo = is_echo(share, cancelled_db, answer_said, excess_db)
        if echo and not self.echo_heard:
            logger.debug("echo heard in a check: the detectors hear the canceller from now on")
        self.echo_heard = self.echo_heard or echo  # rule 7
        return echo

    def _coupling(self, speech: int, checked: int) -> Coupling | None:
        """Rule 6: the room's coupling for the speech that began at clock index `speech`,
        learnt on the `LEARNT_MS` before the span a check looks at (from `checked` on),
        and kept for the speech once learnt. Until then each check tries again: a
        speech that began on the echo teaches it once a person joins in."""
        if self._learnt is None or self._learnt[0] != speech:
            self._learnt = (speech, None)
        if self._learnt[1] is None:
            start = max(checked - LEARNT_MS * ENGINE_RATE // 1000, self._heard.oldest)
            start = max(start, self._played.oldest + MAX_DELAY)
            if checked > start:
                echo = self._heard.read(start, checked - start)
                far = self._played.read(start - MAX_DELAY, checked - start + MAX_DELAY)
                self._learnt = (speech, Coupling.learn(echo, far))
        return self._learnt[1]

    def restart(self, at_ms: float) -> None:
        """The next input sample is at session time `at_ms` (after a flush, rule 4)."""
        self._held = _NO_SAMPLES
        self._next = round(at_ms * ENGINE_RATE / 1000)

    def _frame(self, frame: Samples) -> Samples:
        at, self._next = self._next, self._next + FRAME
        far = self._far_end.read(at, FRAME) if self._echo and self._played_within_tail(at) else None
        if self._echo:
            self._heard.write(at, frame)
            self._played.write(at, far)
        if self._noise is None and far is None:
            if self._echo:
                self._cleaned.write(at, frame)
            return frame  # rule 3
        self.frames_processed += 1
        apm = self._warmed_module()
        if far is not None:
            apm.process_reverse_stream(_frame(_pcm(far)))
            # The reference is already on the session clock: AEC3 estimates the rest.
            apm.set_stream_delay_ms(0)
        near = _frame(_pcm(frame))
        apm.process_stream(near)
        cleaned = np.frombuffer(near.data, np.int16).astype(np.float32) / _INT16
        if not self._echo:
            return cleaned
        self._cleaned.write(at, cleaned)
        if self.echo_heard or self._noise is not None:
            return cleaned
        if far is not None:
            self._weigh(frame, cleaned)
        return cleaned if self.echo_heard else frame  # rule 7

    def _weigh(self, frame: Samples, cleaned: Samples) -> None:
        """Rule 7: over each `COUPLING_WINDOW_MS` of far-end audio, whether the
        canceller took `CANCELLED_DB` or more off a microphone that heard something."""
        window = self._weighed
        window.samples += len(frame)
        window.heard += energy(frame)
        window.left += energy(cleaned)
        if window.samples < _COUPLING_WINDOW:
            return
        self._weighed = _Weighing()
        if window.heard / window.samples < _HEARD_SOMETHING:
            return  # a pause in the answer, or its echo: says nothing either way
        cancelled_db = 10 * np.log10((window.heard + 1e-12) / (window.left + 1e-12))
        self._coupled_windows = self._coupled_windows + 1 if cancelled_db >= CANCELLED_DB else 0
        if self._coupled_windows >= COUPLING_WINDOWS:
            self.echo_heard = True
            logger.debug(
                "echo heard: %d windows of %d ms with %.1f dB or more cancelled; the "
                "detectors hear the canceller from now on",
                COUPLING_WINDOWS,
                COUPLING_WINDOW_MS,
                CANCELLED_DB,
            )

    def _played_within_tail(self, at: int) -> bool:
        """Whether the far end played within `ECHO_TAIL_MS` before clock index `at`."""
        until = self._far_end.played_until
        return until is not None and until > at - _TAIL

    def _start_warm_up(self) -> None:
        """Rules 5 and 8: the echo canceller's warm-up, once, on the worker thread."""
        if self._echo and not self._warm:
            self._warm = True
            if self._apm is None:
                self._apm = _module(self._echo, self._noise)
            self._warming = _WARM_UPS.submit(_warm_up, self._apm)

    def _warmed_module(self) -> AudioProcessingModule:
        """The module, once its warm-up is done: the worker no longer uses it (rule 8)."""
        assert self._apm is not None
        if self._warming is not None:
            self._warming.result()  # at once, but for a far end that came unannounced
            self._warming = None
        return self._apm


@dataclass
class _Weighing:
    """Energy of the microphone and of what the canceller left of it, over a window."""

    samples: int = 0
    heard: float = 0.0
    left: float = 0.0


class _History:
    """The last `HISTORY_S` of a stream, written frame by frame on the session clock."""

    _SIZE = HISTORY_S * ENGINE_RATE

    def __init__(self) -> None:
        self._ring = np.zeros(self._SIZE, np.float32)
        self._end = 0  # the clock index after the last sample written
        self._start = 0  # the clock index of the oldest sample still held

    @property
    def oldest(self) -> int:
        return self._start

    def write(self, at: int, frame: Samples | None) -> None:
        """`frame` (None: silence) from clock index `at`. The clock may step back within
        what is held (a flush pads its last frame, then the session clock takes the
        padding back, rule 4): later frames overwrite from there, and the history before
        stays, so the first check after a commit still sees the speech and the far end
        before it. A step forward is silence; a step back past the oldest sample held
        starts the history again."""
        if at < self._start:
            self._start = at
        elif at > self._end:
            gap = np.arange(max(self._end, at - self._SIZE), at)
            self._ring[gap % self._SIZE] = 0.0
        self._end = at + FRAME
        self._start = max(self._start, self._end - self._SIZE)
        self._ring[np.arange(at, at + FRAME) % self._SIZE] = 0.0 if frame is None else frame

    def read(self, start: int, count: int) -> Samples:
        """`count` samples from clock index `start`, silence where none are held."""
        out = np.zeros(count, np.float32)
        lo, hi = max(start, self._start), min(start + count, self._end)
        if hi > lo:
            out[lo - start : hi - start] = self._ring[np.arange(lo, hi) % self._SIZE]
        return out


def _warm_up(apm: AudioProcessingModule) -> None:
    """Rule 5: a synthetic far end over a silent microphone, as a headset hears it."""
    noise = np.random.default_rng(0).standard_normal(WARM_S * ENGINE_RATE) * _WARM_LEVEL
    silence = bytes(FRAME * 2)
    for lo in range(0, len(noise), FRAME):
        far = noise[lo : lo + FRAME].astype(np.float32)
        apm.process_reverse_stream(_frame(_pcm(far)))
        apm.set_stream_delay_ms(0)
        apm.process_stream(_frame(bytearray(silence)))


def _module_now(echo: bool, noise: NoiseReduction | None) -> AudioProcessingModule | None:
    """The module a session needs from its first frame: noise suppression's. The echo
    canceller alone waits for the first spoken response (rule 8): its state is about
    0.4 MiB, and a session that never speaks never needs it."""
    return _module(echo, noise) if noise is not None else None


def _module(echo: bool, noise: NoiseReduction | None) -> AudioProcessingModule:
    from livekit.rtc import AudioProcessingModule

    # The high-pass filter removes DC and rumble below speech, which both the echo
    # canceller and the noise suppressor otherwise spend effort on.
    return AudioProcessingModule(
        echo_cancellation=echo, noise_suppression=noise is not None, high_pass_filter=True
    )


def _frame(pcm: bytearray) -> AudioFrame:
    from livekit.rtc import AudioFrame

    return AudioFrame(pcm, ENGINE_RATE, 1, FRAME)


def _pcm(samples: Samples) -> bytearray:
    return bytearray((np.clip(samples, -1.0, 1.0) * _INT16).astype(np.int16).tobytes())
