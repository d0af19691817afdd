"""Each pipeline stage's options for a session, as the port's `sampling_params` carry them.

One entry per stage, in stage order: `AsrParams`, the LLM's `SamplingParams`
(`engine.runtime.request`), `TtsParams`. A turn runs with the options of its session's config
generation; the turn request may override some of them (`duplex.turn.TurnRequest`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.runtime.request import SamplingParams

__all__ = ["AsrParams", "TtsParams", "check_params"]


@dataclass(frozen=True)
class AsrParams:
    """Stage-0 options: turns with more audio than `max_audio_s` are refused."""

    max_audio_s: float = 120.0


@dataclass(frozen=True)
class TtsParams:
    """Stage-2 options: which voice speaks, how fast, and its noise settings."""

    voice: str
    speed: float = 1.0
    noise_scale: float | None = None
    noise_w: float | None = None


def check_params(params: tuple[Any, ...]) -> None:
    """Raise ValueError unless `params` holds one entry of the right type per stage."""
    expected = (AsrParams, SamplingParams, TtsParams)
    for stage, (value, kind) in enumerate(zip(params, expected, strict=True)):
        if not isinstance(value, kind):
            raise ValueError(
                f"sampling_params[{stage}] must be {kind.__name__}, got {type(value).__name__}"
            )
