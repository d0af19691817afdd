"""What is asked of the ASR stage and what it answers, without the model (numpy only):
the gateway builds requests too, and must not load MLX to do it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["NOT_SCORED", "SENTENCE_ENDS", "SURE_LOGPROB", "AsrRequest", "Transcription"]

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
