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
"""

from __future__ import annotations

import difflib
import re

import numpy as np

from gateway.protocol.audio import ENGINE_RATE, Samples

__all__ = ["ECHO_SHARE", "MAX_DELAY", "answer_said", "echo_share"]

# A clip whose energy the far end explains this much or more is the echo alone.
ECHO_SHARE = 0.5
MAX_DELAY = ENGINE_RATE // 2  # the longest echo path looked for: 500 ms, in samples
_WINDOW = 512  # 32 ms short-time spectrum frames...
_HOP = 128  # ...every 8 ms
TAPS = 8  # far-end frames per bin: the delay's and the 7 before it (56 ms more)
_RIDGE = 1e-6  # keeps the per-bin fit defined where the far end was silent


def echo_share(mic: Samples, far: Samples) -> float:
    """The share (0 to 1) of `mic`'s energy explained by the far end. `far` is the far
    end from `MAX_DELAY` samples before `mic`'s first sample to its last, on the same
    clock (silence where nothing played)."""
    if len(far) != len(mic) + MAX_DELAY:
        raise ValueError("far must start MAX_DELAY samples before mic and end with it")
    if len(mic) < _WINDOW + TAPS * _HOP:
        return 0.0
    mic64, far64 = mic.astype(np.float64), far.astype(np.float64)
    if not np.any(mic64) or not np.any(far64):
        return 0.0
    lag = _direct_path(mic64, far64)
    # The far end aligned with the microphone at the direct path, with the TAPS - 1
    # hops before it in front (what reflections bring later).
    front = (TAPS - 1) * _HOP
    aligned = np.zeros(front + len(mic64))
    lo = lag - front
    aligned[max(-lo, 0) :] = far64[max(lo, 0) : lag + len(mic64)]
    spectrum = _stft(mic64)  # (frames, bins)
    frames = len(spectrum)
    far_spectrum = _stft(aligned)
    taps = np.stack(
        [far_spectrum[TAPS - 1 - k : TAPS - 1 - k + frames] for k in range(TAPS)], axis=2
    ).transpose(1, 0, 2)  # (bins, frames, taps)
    wanted = spectrum.T  # (bins, frames)
    gram = np.einsum("ftk,ftj->fkj", taps.conj(), taps)
    target = np.einsum("ftk,ft->fk", taps.conj(), wanted)
    scale = np.trace(gram, axis1=1, axis2=2).real / TAPS
    ridge = (_RIDGE * scale + 1e-12)[:, None, None] * np.eye(TAPS)
    fitted = np.linalg.solve(gram + ridge, target[..., None])[..., 0]
    residual = wanted - np.einsum("ftk,fk->ft", taps, fitted)
    total = float(np.sum(np.abs(wanted) ** 2))
    return max(0.0, 1.0 - float(np.sum(np.abs(residual) ** 2)) / total) if total else 0.0


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
