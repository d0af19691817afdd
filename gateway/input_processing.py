"""A session's input audio cleaned before anything hears it: WebRTC's audio processing
module (AEC3 echo canceller, noise suppression, high-pass filter) from the `livekit`
wheel.

Rules of this module:

1. It sits on the one input path, after the resampler to 16 kHz (`gateway.input_buffer`)
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
6. The module's work (about 15 ms of CPU per second of audio while the canceller is
   active, bench/echo.py measures it; the warm-up's 90 ms once, when a session's first
   answer starts to play) runs where `runner` puts it: the gateway hands it to a
   thread below the event loop's priority (`gateway.input_lane`), one job per push, in
   order. Framing, the pass-through decision and the far-end reference of each frame
   are settled on the caller's thread when the samples are pushed, so the far end
   (which the session changes as it sends and truncates audio) is read there only,
   at the same positions as when the work was done in place. A push returns the output
   of the jobs finished so far (`ready` returns the rest later); a push with
   `last=True` waits for all of them. Frames that pass on while nothing is in flight
   come back at once; the default runner works in place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from gateway.audio import ENGINE_RATE, Samples
from gateway.far_end import FarEnd

if TYPE_CHECKING:  # livekit's library starts threads of its own: loaded only when used
    from livekit.rtc import AudioFrame, AudioProcessingModule

__all__ = [
    "ECHO_TAIL_MS",
    "FRAME",
    "WARM_S",
    "InputProcessing",
    "Job",
    "NoiseReduction",
    "Runner",
    "run_inline",
]

FRAME = ENGINE_RATE // 100  # the module's 10 ms frame, in samples
# How long after the far end's last played sample its echo may still arrive: the
# longest delay AEC3 follows plus a reverberation tail.
ECHO_TAIL_MS = 1500
_TAIL = ECHO_TAIL_MS * ENGINE_RATE // 1000
WARM_S = 6  # rule 5
_WARM_LEVEL = 0.05  # the synthetic far end's RMS (-26 dBFS), about a voice's level
_INT16 = 32767.0
_NO_SAMPLES: Samples = np.zeros(0, np.float32)

# One push's work, and what runs it (rule 6): the runner returns the job's future and
# runs the jobs it is given one after another, in the order given.
Job = Callable[[], Samples]
Runner = Callable[[Job], "Future[Samples]"]


def run_inline(job: Job) -> Future[Samples]:
    """The default runner: the job runs in place, on the caller's thread."""
    future: Future[Samples] = Future()
    try:
        future.set_result(job())
    except Exception as exc:
        future.set_exception(exc)
    return future


@dataclass(frozen=True)
class NoiseReduction:
    """OpenAI's `noise_reduction`: `near_field` (a headset or a phone held to the ear),
    `far_field` (a laptop or a conference room microphone)."""

    type: Literal["near_field", "far_field"]


# A planned frame: near-end samples, and the far end played at their position (None:
# the frame passes on untouched, rule 3).
_Planned = tuple[Samples, Samples | None]


class InputProcessing:
    """The processing of one session's 16 kHz input stream, from session time `start_ms`."""

    def __init__(
        self,
        far_end: FarEnd,
        *,
        echo_cancellation: bool,
        noise_reduction: NoiseReduction | None,
        start_ms: float,
        runner: Runner = run_inline,
    ) -> None:
        self._far_end = far_end
        self._runner = runner
        self._module = _Module.of(echo_cancellation, noise_reduction)
        self._held: Samples = _NO_SAMPLES
        self._next = round(start_ms * ENGINE_RATE / 1000)  # clock index of the next frame
        self._in_flight: deque[Future[Samples]] = deque()  # jobs' outputs, in order
        self.frames_processed = 0  # frames handed to the module (rule 5)

    @property
    def enabled(self) -> bool:
        return self._module is not None

    def configure(self, *, echo_cancellation: bool, noise_reduction: NoiseReduction | None) -> None:
        """New settings: a fresh module if they changed (the held frame is kept; jobs
        already handed over finish with the module they were planned for)."""
        current = self._module.settings if self._module is not None else (False, None)
        if (echo_cancellation, noise_reduction) != current:
            self._module = _Module.of(echo_cancellation, noise_reduction)

    def push(self, samples: Samples, last: bool = False) -> Samples:
        """The processed samples that are complete so far, in order (rules 4, 6)."""
        audio = np.concatenate([self._held, samples]) if self._held.size else samples
        if self._module is None:
            # Nothing to do: pass everything on, keeping the clock position.
            self._held = _NO_SAMPLES
            self._next += len(audio)
            self._far_end.forget_before(self._next)
            return self._after_jobs(audio, last)
        whole = len(audio) // FRAME * FRAME
        real = whole
        if last and whole < len(audio):
            real = len(audio)
            whole += FRAME
            audio = np.concatenate([audio, np.zeros(whole - len(audio), np.float32)])
        plan = [self._plan(audio[lo : lo + FRAME]) for lo in range(0, whole, FRAME)]
        self._held = audio[whole:].copy() if not last else _NO_SAMPLES
        self._far_end.forget_before(self._next)
        if all(far is None for _, far in plan):
            return self._after_jobs(audio[:real], last)
        self.frames_processed += sum(far is not None for _, far in plan)
        module = self._module
        self._in_flight.append(self._runner(lambda: module.run(plan)[:real]))
        return self._wait() if last else self.ready()

    def ready(self) -> Samples:
        """The output of the jobs finished since the last call, in order (rule 6)."""
        done: list[Samples] = []
        while self._in_flight and self._in_flight[0].done():
            done.append(self._in_flight.popleft().result())
        return _joined(done)

    def restart(self, at_ms: float) -> None:
        """The next input sample is at session time `at_ms` (after a flush, rule 4)."""
        self._held = _NO_SAMPLES
        self._next = round(at_ms * ENGINE_RATE / 1000)

    def _plan(self, frame: Samples) -> _Planned:
        """A frame at the next clock position, with its far end if the module hears it."""
        at, self._next = self._next, self._next + FRAME
        assert self._module is not None
        if self._module.noise is None:
            until = self._far_end.played_until
            if until is None or until <= at - _TAIL:
                return frame, None  # rule 3
        far = self._far_end.read(at, FRAME) if self._module.echo else _NO_SAMPLES
        return frame, far

    def _after_jobs(self, audio: Samples, last: bool) -> Samples:
        """`audio` needs no work: it comes after the jobs in flight, if any (rule 6)."""
        if not self._in_flight:
            return audio
        if audio.size:
            future: Future[Samples] = Future()
            future.set_result(audio)
            self._in_flight.append(future)
        return self._wait() if last else self.ready()

    def _wait(self) -> Samples:
        """Every job's output, waiting for those still running (a flush, rule 6)."""
        done = [future.result() for future in self._in_flight]
        self._in_flight.clear()
        return _joined(done)


class _Module:
    """One configuration of WebRTC's module, created by the first job that needs it (so
    livekit's threads are started by the thread that runs the jobs) and used only there."""

    def __init__(self, echo: bool, noise: NoiseReduction | None) -> None:
        self.echo = echo
        self.noise = noise
        self._apm: AudioProcessingModule | None = None
        self._warm = False  # the module has had its warm-up (rule 5)

    @classmethod
    def of(cls, echo: bool, noise: NoiseReduction | None) -> _Module | None:
        return cls(echo, noise) if echo or noise is not None else None

    @property
    def settings(self) -> tuple[bool, NoiseReduction | None]:
        return self.echo, self.noise

    def run(self, plan: list[_Planned]) -> Samples:
        """Each planned frame through the module, or passed on."""
        out = np.empty(len(plan) * FRAME, np.float32)
        for n, (near, far) in enumerate(plan):
            out[n * FRAME : (n + 1) * FRAME] = near if far is None else self._frame(near, far)
        return out

    def _frame(self, near: Samples, far: Samples) -> Samples:
        apm = self._started()
        if self.echo:
            if not self._warm:
                self._warm_up(apm)
            apm.process_reverse_stream(_frame(_pcm(far)))
            # The reference is already on the session clock: AEC3 estimates the rest.
            apm.set_stream_delay_ms(0)
        frame = _frame(_pcm(near))
        apm.process_stream(frame)
        return np.frombuffer(frame.data, np.int16).astype(np.float32) / _INT16

    def _started(self) -> AudioProcessingModule:
        if self._apm is None:
            from livekit.rtc import AudioProcessingModule

            # The high-pass filter removes DC and rumble below speech, which both the echo
            # canceller and the noise suppressor otherwise spend effort on.
            self._apm = AudioProcessingModule(
                echo_cancellation=self.echo,
                noise_suppression=self.noise is not None,
                high_pass_filter=True,
            )
        return self._apm

    def _warm_up(self, apm: AudioProcessingModule) -> None:
        """Rule 5: a synthetic far end over a silent microphone, as a headset hears it."""
        self._warm = True
        noise = np.random.default_rng(0).standard_normal(WARM_S * ENGINE_RATE) * _WARM_LEVEL
        silence = bytes(FRAME * 2)
        for lo in range(0, len(noise), FRAME):
            far = noise[lo : lo + FRAME].astype(np.float32)
            apm.process_reverse_stream(_frame(_pcm(far)))
            apm.set_stream_delay_ms(0)
            apm.process_stream(_frame(bytearray(silence)))


def _joined(parts: list[Samples]) -> Samples:
    if not parts:
        return _NO_SAMPLES
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _frame(pcm: bytearray) -> AudioFrame:
    from livekit.rtc import AudioFrame

    return AudioFrame(pcm, ENGINE_RATE, 1, FRAME)


def _pcm(samples: Samples) -> bytearray:
    return bytearray((np.clip(samples, -1.0, 1.0) * _INT16).astype(np.int16).tobytes())
