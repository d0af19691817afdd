"""What `bench/echo.py` shares with its offline part: speech clips and levels, the
microphone a client records, and the measures taken on it."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
from _rooms import RATE

from gateway.protocol.audio import ENGINE_RATE

FRAME = RATE * 40 // 1000  # one 40 ms append
VOICE_DBFS = -24.0  # the user's (and the person's) active speech level at the microphone
NOISE_DBFS = -65.0  # the microphone's noise floor
PERSON_AFTER_S = 1.5  # the person talks over the answer this far into its playback
PERSON = (
    "Hold on, can we talk about the weather tomorrow instead?",
    "Wait, please stop, I have another question.",
)
ALSA = Path("/usr/share/sounds/alsa")


# ---- speech clips -----------------------------------------------------------------------


def espeak(text: str, voice: str = "en-us") -> np.ndarray:
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        subprocess.run(["espeak-ng", "-v", voice, "-w", wav.name, text], check=True)
        audio, rate = sf.read(wav.name, dtype="float32")
    return level(soxr.resample(audio, rate, RATE).astype(np.float32))


def recording(name: str) -> np.ndarray:
    audio, rate = sf.read(ALSA / name, dtype="float32")
    return level(soxr.resample(audio, rate, RATE).astype(np.float32))


def active_rms(audio: np.ndarray) -> float:
    frames = audio[: len(audio) // 480 * 480].reshape(-1, 480)
    power = np.mean(frames.astype(np.float64) ** 2, axis=1)
    active = power[power > power.max() * 1e-3]
    return float(np.sqrt(np.mean(active))) if active.size else 0.0


def level(audio: np.ndarray, dbfs: float = VOICE_DBFS) -> np.ndarray:
    return (audio * (10 ** (dbfs / 20) / max(active_rms(audio), 1e-9))).astype(np.float32)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def word_errors(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[:], i
        for j, h in enumerate(hyp, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (r != h))
    return row[-1]


def wer(refs: list[str], hyps: list[str]) -> float:
    errors = sum(word_errors(words(r), words(h)) for r, h in zip(refs, hyps, strict=True))
    return errors / sum(len(words(r)) for r in refs)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


@dataclass
class Recording:
    """What a client's microphone sent, with its parts, and what it played when."""

    mic: list[np.ndarray] = field(default_factory=list)
    echo: list[np.ndarray] = field(default_factory=list)
    near: list[np.ndarray] = field(default_factory=list)
    played: list[tuple[int, str, np.ndarray]] = field(default_factory=list)  # (mic sample, ...)
    truncated: list[tuple[int, str, float]] = field(default_factory=list)


def to_engine(audio: np.ndarray) -> np.ndarray:
    return soxr.resample(audio, RATE, ENGINE_RATE).astype(np.float32)


def erle_db(echo: np.ndarray, out: np.ndarray, near: np.ndarray) -> float:
    """Over the 10 ms frames with echo and no one speaking, after the first second of
    echo (while AEC3 converges)."""
    n = min(len(echo), len(out), len(near)) // 160 * 160

    def power(x: np.ndarray) -> np.ndarray:
        return np.mean(x[:n].reshape(-1, 160).astype(np.float64) ** 2, axis=1)

    e, o, s = power(echo), power(out), power(near)
    active = np.flatnonzero((e > 10 ** (-55 / 10)) & (s < 1e-9))
    if active.size < 200:
        return float("nan")
    frames = active[active >= active[0] + 100]
    return float(10 * np.log10(e[frames].sum() / max(o[frames].sum(), 1e-12)))


def person_kept_db(near: np.ndarray, out: np.ndarray, at: int, length: int) -> float:
    """The output's level against the person's while they talk over the echo: near 0 dB
    when the person comes through, far below when double talk is suppressed."""
    lo, hi = at * ENGINE_RATE // RATE, (at + length) * ENGINE_RATE // RATE
    n, o = near[lo:hi].astype(np.float64), out[lo:hi].astype(np.float64)
    return float(10 * np.log10(np.sum(o**2) / max(np.sum(n**2), 1e-12)))
