"""What is asked of the ASR stage and what it answers, without the model (numpy only):
the gateway builds requests too, and must not load MLX to do it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "NOT_SCORED",
    "SENTENCE_ENDS",
    "SURE_LOGPROB",
    "AsrRequest",
    "Transcription",
    "check_audio",
    "merge_parts",
    "split_long_audio",
]

SAMPLE_RATE = 16000
CHUNK_MAX_SECONDS = 28.0  # parts of long audio leave room for the pad inside 30 s

NOT_SCORED = float("nan")  # the log-probability reported for a forced token
# A token Whisper gives less than this (p = 0.37) it is unsure of: the mishearings two
# live guesses share, and the words it makes up to complete a cut phrase, mostly are.
SURE_LOGPROB = -1.0
# What Whisper ends a sentence with; it closes each whole sentence it hears with one.
SENTENCE_ENDS = (".", "?", "!")


@dataclass(frozen=True, eq=False)
class AsrRequest:
    """One transcription asked of the ASR stage (engine/stages/asr.py says what each field does)."""

    audio: np.ndarray  # float32 16 kHz mono, the utterance from its start
    prefix: tuple[int, ...] = ()  # tokens forced as the transcript's start
    prompt: str = ""  # previous text, given to Whisper after <|startofprev|>
    logprobs: bool = False  # report each token's log-probability
    partial: bool = False  # live work: after every final request, in one try
    urgent: bool = False  # the main lane waits while it runs (engine.runtime.urgency)
    greedy: bool = False  # no beam search: a quick check, not the best reading


@dataclass
class Transcription:
    text: str
    tokens: list[int]
    window_frames: int  # mel frames the encoder saw in the accepted attempt
    attempts: int  # 1 = the first (shortest) window was accepted
    duration_s: float
    # Each token's log-probability, aligned with `tokens`, when the request asked for
    # them (NOT_SCORED for the forced prefix's tokens); else empty.
    logprobs: list[float] = field(default_factory=list)


def split_long_audio(audio: np.ndarray, max_s: float = CHUNK_MAX_SECONDS) -> list[np.ndarray]:
    """Split audio into parts of at most `max_s`, cutting at the quietest 20 ms frame of
    each part's last quarter so words are not cut in two."""
    max_len, hop = int(max_s * SAMPLE_RATE), SAMPLE_RATE // 50
    parts, start = [], 0
    while len(audio) - start > max_len:
        lo, hi = start + max_len * 3 // 4, start + max_len
        frames = audio[lo:hi][: (hi - lo) // hop * hop].reshape(-1, hop)
        cut = lo + int(np.argmin((frames**2).mean(axis=1))) * hop + hop // 2
        parts.append(audio[start:cut])
        start = cut
    parts.append(audio[start:])
    return parts


def merge_parts(parts: list[Transcription], duration_s: float) -> Transcription:
    """One transcription of audio transcribed in parts (`split_long_audio`)."""
    if len(parts) == 1:
        return parts[0]
    text = " ".join(p.text for p in parts if p.text)
    tokens = [t for p in parts for t in p.tokens]
    scores = [s for p in parts for s in p.logprobs]
    frames = max(p.window_frames for p in parts)
    attempts = max(p.attempts for p in parts)
    return Transcription(text, tokens, frames, attempts, duration_s, scores)


def check_audio(audio: np.ndarray) -> np.ndarray:
    """The audio as float32; ValueError for what cannot be transcribed."""
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise ValueError(f"audio must be mono (1-D), got shape {audio.shape}")
    if not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"audio must be float samples in [-1, 1], got {audio.dtype}")
    audio = audio.astype(np.float32, copy=False)
    if not np.isfinite(audio).all():
        raise ValueError("audio contains NaN or infinite samples")
    return audio
