"""The turn-end stage: Smart Turn scores whether a user's speech so far is a finished turn.

A request is the audio of one turn up to a silence (16 kHz float32 mono; only its last
8 s are read). Each step scores up to `max_batch` waiting requests in one batched pass
and finishes each with one output, its probability that the turn is complete. The
log-mel features are computed on the engine thread too, so the event loop only hands
audio over and reads a number back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.models import smart_turn
from engine.runtime.stage import StageOutput

__all__ = ["DEFAULT_MODEL", "TurnEndModel", "TurnEndStage"]

DEFAULT_MODEL = "smart-turn-v3.2"


class TurnEndModel:
    """Smart Turn on MLX: probabilities for a batch of audio clips."""

    def __init__(self, model_dir: Path | str) -> None:
        self.model = smart_turn.load(Path(model_dir))

    @classmethod
    def from_registry(cls, name: str = DEFAULT_MODEL) -> TurnEndModel:
        from engine.weights import registry

        return cls(registry.prepare(name))

    def complete_probability(self, clips: list[np.ndarray]) -> np.ndarray:
        """(len(clips),) probabilities that each clip ends a finished turn."""
        if not clips:
            return np.zeros(0, np.float32)
        mel = np.stack([smart_turn.features(clip) for clip in clips])
        probs = self.model(mx.array(mel))
        mx.eval(probs)
        return np.array(probs, dtype=np.float32)


class TurnEndStage:
    name = "turn"

    def __init__(self, model: TurnEndModel, *, max_batch: int = 8) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.model = model
        self.max_batch = max_batch
        self._waiting: dict[str, np.ndarray] = {}

    def add(self, request_id: str, inputs: Any) -> None:
        clip = np.asarray(inputs)
        if clip.dtype.kind != "f" or clip.ndim != 1 or not clip.size:
            raise ValueError("a turn-end request is non-empty 1-D float audio at 16 kHz")
        if not np.isfinite(clip).all():
            raise ValueError("audio contains NaN or infinite samples")
        if request_id in self._waiting:
            raise ValueError(f"turn-end request {request_id!r} is already waiting")
        self._waiting[request_id] = clip[-smart_turn.WINDOW_SAMPLES :].astype(np.float32)

    def abort(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._waiting)

    def step(self) -> list[StageOutput]:
        ids = list(self._waiting)[: self.max_batch]
        clips = [self._waiting.pop(rid) for rid in ids]
        probs = self.model.complete_probability(clips)
        return [
            StageOutput(rid, float(p), finished=True) for rid, p in zip(ids, probs, strict=True)
        ]
