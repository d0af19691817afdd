"""The voices the TTS stage speaks with: what a request asks of a voice (`TtsRequest`),
what the stage needs of one (`VoiceModel`), and a Piper voice on MLX (`Voice`); Kokoro's
voices are in `engine.stages.kokoro_voice`. `open_voice` loads whichever a converted
model folder holds.

A Piper voice renders a clause in windows: the clause's latents are computed whole (the
text encoder and duration predictor need every phoneme), but the flows and the vocoder,
both convolutional, run over windows of latent frames with enough context on each side
that the window's middle equals the whole clause's audio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from engine.models import vits
from engine.stages.phonemes import get_phonemizer, phoneme_ids
from engine.stages.tts_text import MAX_PIECE_PHONEMES, split_phonemes

__all__ = [
    "DEFAULT_VOICE",
    "Scales",
    "TtsRequest",
    "Voice",
    "VoiceModel",
    "load_voice",
    "open_voice",
    "padded_ids",
    "stack_frames",
    "synthesize_pieces",
]

DEFAULT_VOICE = "piper-en_US-joe-medium"


@dataclass(frozen=True)
class TtsRequest:
    """Per-request voice settings; None takes the voice's own default.

    `speed` is a multiplier on speaking rate (2.0 = twice as fast); `length_scale` is
    Piper's own knob (its inverse). Give at most one of the two.
    """

    speed: float | None = None
    length_scale: float | None = None
    noise_scale: float | None = None
    noise_w: float | None = None
    voice: str | None = None  # of a model with several voices (Kokoro); None: its default

    def __post_init__(self) -> None:
        if self.speed is not None and self.length_scale is not None:
            raise ValueError("give speed or length_scale, not both")
        for name in ("speed", "length_scale"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0.1 <= value <= 10.0):
                raise ValueError(f"{name} must be within [0.1, 10]")
        for name in ("noise_scale", "noise_w"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0.0 <= value <= 2.0):
                raise ValueError(f"{name} must be within [0, 2]")


@dataclass(frozen=True)
class Scales:
    noise_scale: float
    length_scale: float
    noise_w: float


class VoiceModel(Protocol):
    """What the stage needs of a voice: `Voice` (Piper) or `kokoro_voice.KokoroVoice`.
    `scales` turns a request into the voice's own per-request settings, which
    `latents` takes back; `latents` are the model's inputs to rendering, in frames."""

    sample_rate: int
    whole_segments: bool
    names: tuple[str, ...]
    openai_voices: dict[str, str]

    def scales(self, request: TtsRequest) -> Any: ...
    def give_way_with(self, pause: Callable[[], None] | None) -> None: ...
    def context_frames(self) -> int: ...
    def id_pieces(self, text: str) -> list[list[int]]: ...
    def latents(self, batch: Sequence[list[int]], scales: Sequence[Any]) -> list[mx.array]: ...
    def render(self, spans: Sequence[tuple[mx.array, int, int]]) -> list[np.ndarray]: ...
    def synthesize(self, texts: Sequence[str], scales: Sequence[Any]) -> list[np.ndarray]: ...


class Voice:
    """A converted Piper voice: phonemizer + MLX VITS. A Piper model is one voice, named
    by the profile (`names` empty); it renders windows of a clause (`whole_segments`)."""

    whole_segments = False
    names: tuple[str, ...] = ()
    openai_voices: dict[str, str] = {}

    def __init__(self, model: vits.Model, config: dict) -> None:
        self.model = model
        self.config = config
        args = model.args
        self.sample_rate = args.sample_rate
        self.id_map = config["phoneme_id_map"]
        self.phonemizer = get_phonemizer(config.get("espeak", {}).get("voice", "en-us"))
        # The converter copied the voice json's inference defaults into the model args.
        self.defaults = Scales(args.noise_scale, args.length_scale, args.noise_w)
        self._pause: Callable[[], None] | None = None

    @classmethod
    def load(cls, model_dir: Path | str) -> Voice:
        model, config = vits.load(model_dir)
        return cls(model, config)

    def scales(self, request: TtsRequest) -> Scales:
        d = self.defaults
        length = request.length_scale
        if request.speed is not None:
            length = d.length_scale / request.speed
        return Scales(
            d.noise_scale if request.noise_scale is None else request.noise_scale,
            d.length_scale if length is None else length,
            d.noise_w if request.noise_w is None else request.noise_w,
        )

    def ids(self, text: str) -> list[int]:
        return phoneme_ids(self.phonemizer.phonemize(text), self.id_map)

    def give_way_with(self, pause: Callable[[], None] | None) -> None:
        """A render of a few seconds of speech takes a few hundred ms on a CPU: `pause`
        is called between its flows and its vocoder, and within the vocoder
        (`vits.Generator`); None: renders run whole."""
        self._pause = pause

    def context_frames(self) -> int:
        """Latent frames of context a rendered span needs on each side."""
        return int(self.model.context_frames())

    def id_pieces(self, text: str) -> list[list[int]]:
        """Ids of the text in pieces of at most MAX_PIECE_PHONEMES phonemes."""
        ipa = self.phonemizer.phonemize(text)
        return [phoneme_ids(p, self.id_map) for p in split_phonemes(ipa, MAX_PIECE_PHONEMES)]

    def latents(self, batch: Sequence[list[int]], scales: Sequence[Scales]) -> list[mx.array]:
        """Prior latents [1, frames, C] per id sequence, evaluated (noise drawn once)."""
        z_p, frames = self.model.latents(
            mx.array(padded_ids(batch)),
            mx.array([len(ids) for ids in batch]),
            mx.array([s.noise_scale for s in scales]),
            mx.array([s.length_scale for s in scales]),
            mx.array([s.noise_w for s in scales]),
        )
        out = [z_p[i : i + 1, : int(n)] for i, n in enumerate(frames)]
        mx.eval(out)
        return out

    def render(self, spans: Sequence[tuple[mx.array, int, int]]) -> list[np.ndarray]:
        """Float32 audio of latent frames [start, stop) of each (latents, start, stop),
        equal to that span of the whole sequence's audio, in one batched pass."""
        model = self.model
        context, vocoder_context = model.context_frames(), model.dec.context_frames()
        windows = [_window(z_p, start, stop, context) for z_p, start, stop in spans]
        z = model.flows(*stack_frames([w for w, _ in windows]))
        vits.give_way(z, self._pause)
        # The vocoder needs fewer frames around each span than the flows did.
        windows = [
            _window(z[i : i + 1, : w.shape[1]], a, a + n, vocoder_context)
            for i, (w, (a, n)) in enumerate(windows)
        ]
        audio = np.array(model.vocode(*stack_frames([w for w, _ in windows]), self._pause))
        hop = model.args.hop_length
        return [audio[i, a * hop : (a + n) * hop].copy() for i, (_, (a, n)) in enumerate(windows)]

    def synthesize_ids(
        self, batch: Sequence[list[int]], scales: Sequence[Scales]
    ) -> list[np.ndarray]:
        """Float32 audio at the voice rate, one array per id sequence."""
        z_p = self.latents(batch, scales)
        return self.render([(z, 0, z.shape[1]) for z in z_p])

    def synthesize(self, texts: Sequence[str], scales: Sequence[Scales]) -> list[np.ndarray]:
        return synthesize_pieces(self, texts, scales)


def synthesize_pieces(
    voice: VoiceModel, texts: Sequence[str], scales: Sequence[Any]
) -> list[np.ndarray]:
    """One batched pass over every phoneme piece of every text (each rendered whole);
    audio per text."""
    pieces = [voice.id_pieces(t) for t in texts]
    flat = [ids for ps in pieces for ids in ps]
    flat_scales = [sc for ps, sc in zip(pieces, scales, strict=True) for _ in ps]
    latents = voice.latents(flat, flat_scales) if flat else []
    audio = iter(voice.render([(z, 0, z.shape[1]) for z in latents]) if latents else [])
    return [
        np.concatenate([next(audio) for _ in ps]) if ps else np.zeros(0, np.float32)
        for ps in pieces
    ]


def padded_ids(batch: Sequence[list[int]]) -> np.ndarray:
    """The id sequences as one zero-padded [B, longest] array."""
    padded = np.zeros((len(batch), max(len(ids) for ids in batch)), dtype=np.int32)
    for i, ids in enumerate(batch):
        padded[i, : len(ids)] = ids
    return padded


def _window(z: mx.array, start: int, stop: int, context: int) -> tuple[mx.array, tuple[int, int]]:
    # Frames [start, stop) of z with `context` frames around, and where the span sits in it.
    lo, hi = max(0, start - context), min(z.shape[1], stop + context)
    return z[:, lo:hi], (start - lo, stop - start)


def stack_frames(windows: list[mx.array]) -> tuple[mx.array, np.ndarray]:
    """One zero-padded batch [B, longest, C] and each window's frame count."""
    T = max(w.shape[1] for w in windows)
    batch = mx.concatenate([mx.pad(w, [(0, 0), (0, T - w.shape[1]), (0, 0)]) for w in windows])
    return batch, np.array([w.shape[1] for w in windows])


def load_voice(name: str = DEFAULT_VOICE, voice: str | None = None) -> VoiceModel:
    """A registered voice model, converted into the cache on first use."""
    from engine.weights import registry

    return open_voice(registry.prepare(name), voice)


def open_voice(model_dir: Path | str, voice: str | None = None) -> VoiceModel:
    """The voice model converted into `model_dir`: Kokoro's (a table of voices, `voice`
    the default among them) or a Piper voice."""
    if (Path(model_dir) / "voices.safetensors").is_file():
        from engine.stages.kokoro_voice import DEFAULT_VOICE as KOKORO_DEFAULT
        from engine.stages.kokoro_voice import KokoroVoice

        return KokoroVoice.load(model_dir, voice or KOKORO_DEFAULT)
    return Voice.load(model_dir)
