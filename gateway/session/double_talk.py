"""Double talk: how much of what a microphone heard is the echo of what the client
played.

An echo canceller learning a room lets part of the first answer's echo through, and
the voice detector and Whisper hear that residue as speech and words: a speakerphone
whose echo first reaches the canceller interrupts itself within a second unless a
candidate interruption is checked against the far end.

The check needs no model of the room. The echo is the far end through a linear filter
(a delay, then the room's reflections), so over a clip of pure echo a short filter
fitted from the far end to the microphone explains nearly all of the microphone's
energy, while a person talking adds energy no filter of the far end can explain. The
measure, `echo_share`:

1. finds the delay by the peak of the phase transform of the cross-correlation
   (GCC-PHAT), which stays sharp under reverberation;
2. fits, in each frequency bin of a short-time spectrum, the microphone from the far
   end aligned at that delay and `TAPS` frames before it (the direct path and the
   first reflections, about 90 ms of the room);
3. returns the share of the microphone's energy the fit explains.

Live, in `bench/echo.py`'s eight rooms (bench/RESULTS.md, "The double-talk check"),
the echo that reached a confirmation scored 0.41 to 0.99 and persons talking over it
0.00 to 0.13; `gateway.session.input_processing` combines the share with how much the
canceller took off.

The energy misses some echo (a reverberant hall's scored 0.34 with 1.6 dB taken off),
and the words catch it: Whisper often hears the echo's residue as the words the answer
was speaking ("One day.", "the mountain."), and `answer_said` tells whether the words
that confirmed the speech are the answer's own.

The share is a property of the clip alone, so it also drops for echo the short filter
cannot explain (a long reverberation) and rises for a person whose pauses let the echo
through: over a speakerphone's echo 6 dB below them, persons scored 0.22 to 0.63. What
the room does not change is how loud its echo is for a given far end. So where the
microphone heard the echo alone before a clip, `Coupling` learns from that stretch the
echo's energy per unit of the far end's, and `excess_db` says how far the clip lies
above the echo that coupling makes of the far end then. Live (bench/RESULTS.md, "How
loud the room's echo is"), the echo alone came within 1.3 dB of it; a person's checks
up to 18 dB above it, and 3.2 dB or more once the second checked was mostly theirs.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gateway.protocol.audio import ENGINE_RATE, Samples

__all__ = [
    "ECHO_SHARE",
    "MAX_DELAY",
    "LEARNT_MIN",
    "REVERB",
    "Coupling",
    "answer_said",
    "echo_share",
    "energy",
]

# A clip whose energy the far end explains this much or more is the echo alone.
ECHO_SHARE = 0.5
MAX_DELAY = ENGINE_RATE // 2  # the longest echo path looked for: 500 ms, in samples
_WINDOW = 512  # 32 ms short-time spectrum frames...
_HOP = 128  # ...every 8 ms
TAPS = 8  # far-end frames per bin: the delay's and the 7 before it (56 ms more)
_RIDGE = 1e-6  # keeps the per-bin fit defined where the far end was silent
# The far end's energy that makes a clip's echo is weighed over the clip and this much
# before it: a room's reverberation carries the far end on for a few tenths of a second.
REVERB = ENGINE_RATE // 20
# A coupling is learnt on the clip's last stretch of far-end sound: from `_BUILD_UP`
# after the end of the last pause (`_PAUSE_BLOCKS` 100 ms blocks below -55 dBFS, the gap
# between sentences or answers), at least `LEARNT_MIN` long. Learnt across a pause, the
# far end weighed before the clip's sound holds sound whose echo came earlier; learnt as
# the sound resumes, the room's reverberation has not built up yet. Either way the gain
# comes out low, and later echo seems louder than the room makes it.
LEARNT_MIN = ENGINE_RATE * 3 // 4
_BLOCK = ENGINE_RATE // 10
_PAUSE_BLOCKS = 3
_BUILD_UP = ENGINE_RATE * 3 // 10
_PLAYING = (10 ** (-55 / 20)) ** 2


def echo_share(mic: Samples, far: Samples) -> float:
    """The share (0 to 1) of `mic`'s energy explained by the far end. `far` is the far
    end from `MAX_DELAY` samples before `mic`'s first sample to its last, on the same
    clock (silence where nothing played)."""
    if len(far) != len(mic) + MAX_DELAY:
        raise ValueError("far must start MAX_DELAY samples before mic and end with it")
    mic64, far64 = mic.astype(np.float64), far.astype(np.float64)
    if not np.any(mic64) or not np.any(far64):
        return 0.0
    return _explained(mic64, far64, _direct_path(mic64, far64))


def _explained(mic64: np.ndarray, far64: np.ndarray, lag: int) -> float:
    """`echo_share` with the direct path's index in `far64` found."""
    if len(mic64) < _WINDOW + TAPS * _HOP:
        return 0.0
    # The far end aligned with the microphone at the direct path, with the TAPS - 1
    # hops before it in front (what reflections bring later).
    front = (TAPS - 1) * _HOP
    aligned = np.zeros(front + len(mic64))
    lo = lag - front
    aligned[max(-lo, 0) :] = far64[max(lo, 0) : lag + len(mic64)]
    spectrum = _stft(mic64)  # (frames, bins)
    frames = len(spectrum)
    far_spectrum = _stft(aligned)
    # Each bin's regressors: the far end at the TAPS hops up to each frame's (their
    # order does not change the fit). Views and batched products rather than copies and
    # einsum's loops: this runs on the event loop.
    bins_far = np.ascontiguousarray(far_spectrum.T)  # (bins, frames + TAPS - 1)
    taps_h = sliding_window_view(bins_far.conj(), frames, axis=1)  # (bins, taps, frames)
    taps = sliding_window_view(bins_far, frames, axis=1).transpose(0, 2, 1)
    wanted = spectrum.T[..., None]  # (bins, frames, 1)
    gram = taps_h @ taps
    scale = np.trace(gram, axis1=1, axis2=2).real / TAPS
    ridge = (_RIDGE * scale + 1e-12)[:, None, None] * np.eye(TAPS)
    fitted = np.linalg.solve(gram + ridge, taps_h @ wanted)
    residual = wanted - taps @ fitted
    total = float(np.sum(np.abs(wanted) ** 2))
    return max(0.0, 1.0 - float(np.sum(np.abs(residual) ** 2)) / total) if total else 0.0


@dataclass(frozen=True)
class Coupling:
    """How loud a room's echo is: the microphone's energy per unit of the far end's
    (over each clip and the `REVERB` before it), and the echo's delay in samples."""

    gain: float
    delay: int

    @classmethod
    def learn(cls, echo: Samples, far: Samples) -> Coupling | None:
        """The coupling of a clip of the echo alone (`far` as for `echo_share`), learnt
        on its last stretch of far-end sound; None where that is too short or the far
        end does not explain it (`ECHO_SHARE`): then it was not the echo alone."""
        echo64, far64 = echo.astype(np.float64), far.astype(np.float64)
        if not np.any(echo64) or not np.any(far64):
            return None
        lag = _direct_path(echo64, far64)
        # The clip from its last stretch of sound on, and its far end: the same lag.
        skip = _last_sound(far[lag : lag + len(echo)])
        clip, clip_far = echo64[skip:], far64[skip:]
        if len(clip) < LEARNT_MIN or _explained(clip, clip_far, lag) < ECHO_SHARE:
            return None
        delay = MAX_DELAY - lag
        made = _far_energy(clip_far, len(clip), delay)
        return cls(energy(clip) / made, delay) if made > 0 else None

    def excess_db(self, mic: Samples, far: Samples) -> float:
        """How far `mic`'s energy lies above the echo this coupling makes of the far end
        (`far` as for `echo_share`): about 0 for the echo alone, more with a person."""
        echo = self.gain * _far_energy(far, len(mic), self.delay)
        return float(10 * np.log10((energy(mic) + 1e-12) / (echo + 1e-12)))


def _far_energy(far: Samples | np.ndarray, length: int, delay: int) -> float:
    """The energy of the far end that makes the echo in the `length` samples `far` ends
    with (`far` as for `echo_share`), `delay` samples late, and the `REVERB` before it."""
    end = len(far) - delay
    return energy(far[max(end - length - REVERB, 0) : end])


def _last_sound(far: Samples) -> int:
    """Where in `far` its last stretch of sound begins: after its last pause, once the
    room's reverberation has built up."""
    blocks = far[: len(far) // _BLOCK * _BLOCK].astype(np.float64).reshape(-1, _BLOCK)
    quiet = np.mean(blocks**2, axis=1) < _PLAYING
    run = 0
    for index in range(len(quiet) - 1, -1, -1):
        run = run + 1 if quiet[index] else 0
        if run == _PAUSE_BLOCKS:
            return (index + _PAUSE_BLOCKS) * _BLOCK + _BUILD_UP
    return 0


def energy(samples: Samples | np.ndarray) -> float:
    """The sum of the squared samples, in float64."""
    return float(np.sum(samples.astype(np.float64) ** 2))


# Words too common to tell a person from the answer they talk over.
# fmt: off
_COMMON = frozenset({
    "a", "an", "the", "and", "or", "but", "so", "to", "of", "in", "on", "at", "for",
    "with", "by", "from", "up", "it", "its", "is", "was", "be", "are", "i", "you", "he",
    "she", "we", "they", "me", "my", "your", "his", "her", "our", "their", "this", "that",
    "there", "then", "as", "if", "not", "no", "do", "did", "oh", "uh", "um", "ah", "yeah",
    "yes", "ok", "okay", "what", "who", "where", "when", "why", "how", "which", "have",
    "has", "had", "will", "would", "can", "could", "just", "all", "about", "been", "were",
})
# fmt: on

# A heard word is the answer's when it begins as one of the answer's words does and is
# this close to it (difflib's ratio): Whisper writes "follow" for "followed", "year"
# for "years". A person's "hold" is not the answer's "told" (0.75), nor its "old"
# (0.86, but Whisper's slips keep a word's first letter), nor "stop" its "top".
_SAME_WORD = 0.8


def answer_said(heard: str, answer: str) -> bool:
    """Whether `heard` (a transcript of the microphone) has telling words and at least
    half of them are words of `answer` (what the client played meanwhile): Whisper
    garbles some of the echo's words ("Once on the air." for "Once upon a time")."""
    telling = [w for w in _words(heard) if w not in _COMMON]
    spoken = set(_words(answer))
    said = [w in spoken or _close_to_one_of(w, spoken) for w in telling]
    return bool(said) and 2 * sum(said) >= len(said)


def _close_to_one_of(word: str, spoken: set[str]) -> bool:
    alike = [w for w in spoken if w[0] == word[0]]
    return bool(difflib.get_close_matches(word, alike, n=1, cutoff=_SAME_WORD))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _direct_path(mic: np.ndarray, far: np.ndarray) -> int:
    """The index in `far` whose sample reaches `mic`'s first: GCC-PHAT's peak."""
    size = 1 << int(np.ceil(np.log2(len(far) + len(mic))))
    cross = np.conj(np.fft.rfft(mic, size)) * np.fft.rfft(far, size)
    correlation = np.fft.irfft(cross / (np.abs(cross) + 1e-12), size)
    return int(np.argmax(correlation[: MAX_DELAY + 1]))


def _stft(samples: np.ndarray) -> np.ndarray:
    frames = (len(samples) - _WINDOW) // _HOP + 1
    index = np.arange(_WINDOW)[None, :] + _HOP * np.arange(frames)[:, None]
    return np.fft.rfft(samples[index] * np.hanning(_WINDOW), axis=1)
