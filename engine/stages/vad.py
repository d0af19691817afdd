"""Silero voice activity detection on MLX: batched speech probabilities and the VAD stage.

Audio is 16 kHz float32 mono in [-1, 1], cut into 32 ms chunks of 512 samples. Each
stream carries a `VadState`: the last 64 samples of its previous chunk (the model reads
them in front of the new chunk) and the LSTM's h and c. One forward pass serves one
chunk of every stream in the batch; streams never share state.

`SpeechDetector` (no MLX) turns the probabilities into speech start/stop events; it is
re-exported here so callers of the VAD find everything in one place.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.listening.speech_detector import (
    SpeechDetector,
    SpeechEvent,
    SpeechStarted,
    SpeechStopped,
)
from engine.models import silero
from engine.runtime.stage import StageOutput

__all__ = [
    "DEFAULT_MODEL",
    "SileroVad",
    "SpeechDetector",
    "SpeechEvent",
    "SpeechStarted",
    "SpeechStopped",
    "VadStage",
    "VadState",
    "VadStream",
]

DEFAULT_MODEL = "silero-vad"
# Streams run in zero-padded blocks of this many rows. BLAS picks its kernel (and so its
# rounding) by matrix size, and on some CPUs by a row's place in the block too: on an AMD
# EPYC with OpenBLAS, rows 1, 3, 5-7, 9, 11, 13 and 14 of a 16-row block round differently
# from row 0, while every row of a 4-row block rounds alike. A fixed, small block makes a
# stream's probabilities bit-identical whatever the number of streams batched with it.
DEFAULT_BLOCK = 4


@dataclass(frozen=True)
class VadState:
    """What one stream carries from chunk to chunk."""

    context: np.ndarray  # (context_size,) float32: the tail of the previous chunk
    hidden: np.ndarray  # (2, hidden_size) float32: LSTM h and c


class SileroVad:
    """The Silero model plus the bookkeeping of per-stream state."""

    def __init__(self, model_dir: Path | str, *, block_size: int | None = DEFAULT_BLOCK) -> None:
        valid = isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0
        if block_size is not None and not valid:
            raise ValueError("block_size must be a positive integer or None")
        self.model = silero.load(Path(model_dir))
        # Compiled: the graph is traced once per number of blocks, not built in Python
        # every 32 ms, and its elementwise tails run fused (one stream's pass costs a
        # fifth less than uncompiled; bench/vad.py's rtf_single).
        self._forward_blocks = mx.compile(self.model.__call__)
        self.block_size = block_size
        args = self.model.args
        self.sample_rate: int = args.sample_rate
        self.chunk_size: int = args.chunk_size
        self.context_size: int = args.context_size
        self.hidden_size: int = args.hidden_size

    @classmethod
    def from_registry(cls, name: str = DEFAULT_MODEL) -> SileroVad:
        from engine.weights import registry

        return cls(registry.prepare(name))

    @property
    def chunk_ms(self) -> float:
        return 1000.0 * self.chunk_size / self.sample_rate

    def initial_state(self) -> VadState:
        return VadState(
            context=np.zeros(self.context_size, np.float32),
            hidden=np.zeros((2, self.hidden_size), np.float32),
        )

    def speech_probability(
        self, chunks: np.ndarray, states: list[VadState | None]
    ) -> tuple[np.ndarray, list[VadState]]:
        """Probabilities `(B,)` for one chunk of each of B streams, and their next states.

        `chunks` is `(B, chunk_size)`; `states[i]` is stream i's state (None: a new stream).
        """
        chunks = _as_samples(chunks, ndim=2)
        batch = chunks.shape[0]
        if chunks.shape[1] != self.chunk_size:
            raise ValueError(f"chunks must be (batch, {self.chunk_size}), got {chunks.shape}")
        if len(states) != batch:
            raise ValueError(f"{batch} chunks but {len(states)} states")
        if batch == 0:
            return np.zeros(0, np.float32), []
        current = [s if s is not None else self.initial_state() for s in states]
        x = np.concatenate([np.stack([s.context for s in current]), chunks], axis=1)
        hidden = np.stack([s.hidden for s in current], axis=1)
        probs_np, hidden_np = self._forward(x, hidden)
        tails = chunks[:, -self.context_size :]
        new_states = [
            VadState(context=tails[i].copy(), hidden=hidden_np[:, i].copy()) for i in range(batch)
        ]
        return probs_np, new_states

    def _forward(self, x: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        batch = x.shape[0]
        block = self.block_size or batch
        rows = -(-batch // block) * block
        if rows != batch:
            x = np.pad(x, ((0, rows - batch), (0, 0)))
            hidden = np.pad(hidden, ((0, 0), (0, rows - batch), (0, 0)))
        probs, new_hidden = self._forward_blocks(mx.array(x), mx.array(hidden), block)
        mx.eval(probs, new_hidden)
        return np.array(probs[:batch]), np.array(new_hidden[:, :batch])

    def stream(self) -> VadStream:
        return VadStream(self)


class _ChunkBuffer:
    """Audio of one stream waiting to fill whole chunks. The pieces are kept as they
    came, so an append costs the same however far behind the stream has fallen."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.size = 0
        self._pieces: collections.deque[np.ndarray] = collections.deque()

    def append(self, samples: np.ndarray) -> None:
        if samples.size:
            self._pieces.append(samples)
            self.size += samples.size

    @property
    def ready(self) -> int:
        return self.size // self.chunk_size

    def pop(self) -> np.ndarray:
        parts: list[np.ndarray] = []
        need = self.chunk_size
        while need:
            piece = self._pieces.popleft()
            if len(piece) > need:
                self._pieces.appendleft(piece[need:])
                piece = piece[:need]
            parts.append(piece)
            need -= len(piece)
        self.size -= self.chunk_size
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class VadStream:
    """One stream on its own: feed any amount of audio, get one probability per chunk."""

    def __init__(self, vad: SileroVad) -> None:
        self.vad = vad
        self.state = vad.initial_state()
        self._buffer = _ChunkBuffer(vad.chunk_size)

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """Probabilities of every chunk completed by `samples` (possibly none)."""
        self._buffer.append(_as_samples(samples, ndim=1))
        probs = []
        while self._buffer.ready:
            p, (self.state,) = self.vad.speech_probability(self._buffer.pop()[None], [self.state])
            probs.append(p[0])
        return np.array(probs, dtype=np.float32)


class VadStage:
    """Engine stage: many open audio streams, each step one batched pass per chunk round.

    A stream is opened by `add(stream_id, None)`, receives audio through `feed` and
    stays open until `abort`. A step takes the oldest pending chunk of every stream that
    has one and runs them as one batch; it repeats while chunks remain, at most
    `max_chunks_per_step` rounds, so a stream that fell behind (a burst of appended audio,
    a slow loop iteration) catches up without one step growing unbounded.
    """

    name = "vad"

    def __init__(
        self,
        vad: SileroVad,
        *,
        max_chunks_per_step: int = 16,
        max_pending_ms: int = 30_000,
    ) -> None:
        if max_chunks_per_step < 1:
            raise ValueError("max_chunks_per_step must be at least 1")
        if max_pending_ms < vad.chunk_ms:
            raise ValueError(f"max_pending_ms must be at least one chunk ({vad.chunk_ms} ms)")
        self.vad = vad
        self.max_chunks_per_step = max_chunks_per_step
        self.max_pending_samples = max_pending_ms * vad.sample_rate // 1000
        self._states: dict[str, VadState] = {}
        self._buffers: dict[str, _ChunkBuffer] = {}

    def add(self, request_id: str, inputs: Any) -> None:
        if inputs is not None:
            raise ValueError("a VAD stream is opened with no inputs; send audio with feed()")
        if request_id in self._states:
            raise ValueError(f"VAD stream {request_id!r} is already open")
        self._states[request_id] = self.vad.initial_state()
        self._buffers[request_id] = _ChunkBuffer(self.vad.chunk_size)

    def feed(self, request_id: str, samples: np.ndarray) -> None:
        """Queue 16 kHz float32 mono samples on an open stream."""
        buffer = self._buffers.get(request_id)
        if buffer is None:
            raise KeyError(f"no open VAD stream {request_id!r}")
        samples = _as_samples(samples, ndim=1)
        if buffer.size + len(samples) > self.max_pending_samples:
            # The caller feeds long audio in pieces as the probabilities come back.
            raise ValueError(
                f"VAD stream {request_id!r} would hold more than "
                f"{self.max_pending_samples} unprocessed samples "
                f"({self.max_pending_samples * 1000 // self.vad.sample_rate} ms)"
            )
        buffer.append(samples)

    def feed_many(self, pieces: Sequence[tuple[str, np.ndarray]]) -> list[Exception | None]:
        """`feed` for pieces of many streams in one engine call (the gateway sends every
        session's audio of one event-loop tick together): per piece, in order, None or
        the KeyError or ValueError `feed` would have raised for it."""
        errors: list[Exception | None] = []
        for request_id, samples in pieces:
            try:
                self.feed(request_id, samples)
            except (KeyError, ValueError) as exc:
                errors.append(exc)
            else:
                errors.append(None)
        return errors

    def abort(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._buffers.pop(request_id, None)

    def has_work(self) -> bool:
        return any(b.ready for b in self._buffers.values())

    def step(self) -> list[StageOutput]:
        probs: dict[str, list[float]] = {}
        for _ in range(self.max_chunks_per_step):
            ids = [rid for rid, b in self._buffers.items() if b.ready]
            if not ids:
                break
            chunks = np.stack([self._buffers[rid].pop() for rid in ids])
            p, states = self.vad.speech_probability(chunks, [self._states[rid] for rid in ids])
            for rid, prob, state in zip(ids, p.tolist(), states, strict=True):
                self._states[rid] = state
                probs.setdefault(rid, []).append(prob)
        return [StageOutput(rid, np.array(ps, dtype=np.float32)) for rid, ps in probs.items()]

    def open_streams(self) -> list[str]:
        return list(self._states)


def _as_samples(samples: Any, *, ndim: int) -> np.ndarray:
    array = np.asarray(samples)
    if array.dtype.kind != "f":
        raise ValueError(f"audio must be float samples in [-1, 1], got dtype {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"audio must have {ndim} dimension(s), got shape {array.shape}")
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(array).all():
        raise ValueError("audio contains NaN or infinite samples")
    return array
