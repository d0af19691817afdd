"""Audio for the turn-end tests: eSpeak NG sentences (whole, and cut mid-phrase), the
alsa-utils recordings, silence and noise, all 16 kHz float32 mono."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers import espeak, read_audio

RATE = 16_000
ALSA_SOUNDS = Path("/usr/share/sounds/alsa")
SENTENCES = (
    "Could you tell me what the weather will be like tomorrow in Paris?",
    "I would like to book a table for two people at seven tonight.",
    "Thanks, that is all I needed to know.",
    "My favourite colour has always been a deep shade of blue.",
    "Please remind me to call my sister when I get home.",
)


def read_16k(path: Path) -> np.ndarray:
    return read_audio(path, RATE)


def spoken(text: str, voice: str = "en-us", speed: int = 150) -> np.ndarray:
    return espeak(text, RATE, "-v", voice, "-s", str(speed))


def cut(audio: np.ndarray, fraction: float = 0.6) -> np.ndarray:
    """The first `fraction` of a clip: a sentence stopped mid-phrase."""
    return audio[: int(len(audio) * fraction)]


def turn_end_clips() -> dict[str, np.ndarray]:
    """Twenty named clips."""
    rng = np.random.default_rng(7)
    clips: dict[str, np.ndarray] = {}
    for i, sentence in enumerate(SENTENCES):
        audio = spoken(sentence)
        clips[f"sentence{i}"] = audio
        clips[f"sentence{i}-cut"] = cut(audio)
    for path in sorted(ALSA_SOUNDS.glob("*.wav"))[:6]:
        clips[f"alsa-{path.stem}"] = read_16k(path)
    clips["silence"] = np.zeros(2 * RATE, np.float32)
    clips["white-noise"] = rng.normal(0, 0.05, 3 * RATE).astype(np.float32)
    clips["long-sentence"] = np.concatenate([spoken(s) for s in SENTENCES[:3]])
    clips["quiet-noise"] = rng.normal(0, 0.002, RATE).astype(np.float32)
    return clips
