"""Kokoro-82M's voices behind the TTS stage's voice interface (`voices.VoiceModel`).

One model speaks every voice: a voice is a table of style vectors (one row per phoneme
count), so the requests of different voices share a batch. Phonemes come from eSpeak NG,
as for Piper, with the rewrites Kokoro's espeak-based front end makes (kokoro-js).

Kokoro's decoder normalises over the whole of what it renders (instance norms over time),
so a piece of a clause is rendered in one pass (`whole_segments`): no window of it equals
its share of the whole. A request's first piece is short (`tts_text.first_piece` and the
profile's first clause), which keeps its first audio early.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.models import kokoro
from engine.stages.phonemes import get_phonemizer
from engine.stages.tts_text import MAX_PIECE_PHONEMES, split_phonemes
from engine.stages.voices import TtsRequest, padded_ids, stack_frames, synthesize_pieces

__all__ = ["DEFAULT_VOICE", "KokoroScales", "KokoroVoice", "OPENAI_VOICES", "kokoro_phonemes"]

DEFAULT_VOICE = "af_heart"
# Each OpenAI voice name, spoken by a Kokoro voice of its kind (docs/protocol.md, "Voices").
OPENAI_VOICES = {
    "alloy": "af_alloy",
    "ash": "am_michael",
    "ballad": "bm_fable",
    "cedar": "am_onyx",
    "coral": "af_nova",
    "echo": "am_echo",
    "marin": "af_heart",
    "sage": "af_sarah",
    "shimmer": "af_bella",
    "verse": "bm_george",
}
# American and British English voices: the ones eSpeak's English phonemes suit.
_ENGLISH = ("af_", "am_", "bf_", "bm_")
# kokoro-js's rewrites of eSpeak's IPA into the symbols Kokoro was trained on.
_REWRITES = (
    (re.compile("ʲ"), "j"),
    (re.compile("r"), "ɹ"),
    (re.compile("x"), "k"),
    (re.compile("ɬ"), "l"),
    (re.compile(r"(?<=[a-zɹː])(?=hˈʌndɹɪd)"), " "),
    (re.compile(r' z(?=[;:,.!?¡¿—…"«»“” ]|$)'), "z"),
    (re.compile(r"(?<=nˈaɪn)ti(?!ː)"), "di"),
)


def kokoro_phonemes(ipa: str) -> str:
    for pattern, replacement in _REWRITES:
        ipa = pattern.sub(replacement, ipa)
    return ipa.strip()


@dataclass(frozen=True)
class KokoroScales:
    """A request's voice (its style table) and speaking rate."""

    voice: str
    speed: float


class KokoroVoice:
    """The converted Kokoro model, its voices, and the phonemizer."""

    whole_segments = True

    def __init__(
        self, model: kokoro.Model, config: dict, voices: dict[str, np.ndarray], default: str
    ) -> None:
        if default not in voices:
            raise ValueError(f"Kokoro has no voice {default!r}")
        self.model = model
        self.sample_rate = int(config.get("sample_rate", 24000))
        self.vocab: dict[str, int] = config["vocab"]
        self.styles = voices
        self.default = default
        self.names = (
            default,
            *sorted(n for n in voices if n.startswith(_ENGLISH) and n != default),
        )
        self.openai_voices = {k: v for k, v in OPENAI_VOICES.items() if v in voices}
        self.phonemizer = get_phonemizer("en-us")
        self._pause: Callable[[], None] | None = None

    @classmethod
    def load(cls, model_dir: Path | str, default: str = DEFAULT_VOICE) -> KokoroVoice:
        model, config = kokoro.load(model_dir)
        return cls(model, config, kokoro.load_voices(model_dir), default)

    def scales(self, request: TtsRequest) -> KokoroScales:
        """The request's voice (the default if it names none) and speed; Piper's own
        knobs (length and noise scales) have no meaning here and are refused."""
        if request.length_scale is not None or request.noise_scale is not None:
            raise ValueError("Kokoro takes speed, not Piper's length or noise scales")
        voice = request.voice or self.default
        if voice not in self.styles:
            raise ValueError(f"Kokoro has no voice {voice!r}")
        return KokoroScales(voice, 1.0 if request.speed is None else request.speed)

    def give_way_with(self, pause: Callable[[], None] | None) -> None:
        """A clause renders in seconds on a CPU (2.6 s for 4.5 s of speech): `pause` is
        called between the pieces of each render (`kokoro.Model.decode`); None: renders
        run whole."""
        self._pause = pause

    def context_frames(self) -> int:
        return 0  # pieces are rendered whole

    def ids(self, ipa: str) -> list[int]:
        """Kokoro's ids for IPA: one per known symbol, the pad id 0 at both ends."""
        return [0, *(self.vocab[ch] for ch in kokoro_phonemes(ipa) if ch in self.vocab), 0]

    def id_pieces(self, text: str) -> list[list[int]]:
        ipa = self.phonemizer.phonemize(text)
        return [self.ids(p) for p in split_phonemes(ipa, MAX_PIECE_PHONEMES) if p]

    def latents(self, batch: Sequence[list[int]], scales: Sequence[KokoroScales]) -> list[mx.array]:
        """The decoder's inputs [1, frames, C] per id sequence, evaluated."""
        styles = np.stack(
            [
                kokoro.style_for(self.styles[s.voice], len(ids) - 2)
                for ids, s in zip(batch, scales, strict=True)
            ]
        )
        features, frames = self.model.prepare(
            mx.array(padded_ids(batch)),
            mx.array([len(ids) for ids in batch]),
            mx.array(styles),
            mx.array([s.speed for s in scales], dtype=mx.float32),
        )
        out = [features[i : i + 1, : int(n)] for i, n in enumerate(frames)]
        mx.eval(out)
        return out

    def render(self, spans: Sequence[tuple[mx.array, int, int]]) -> list[np.ndarray]:
        """Audio of each (decoder inputs, start, stop), whole pieces only, in one pass."""
        if any(start != 0 or stop != z.shape[1] for z, start, stop in spans):
            raise ValueError("Kokoro renders whole pieces")
        batch, frames = stack_frames([z for z, _, _ in spans])
        audio = np.array(self.model.decode(batch, frames, pause=self._pause))
        hop = self.model.samples_per_frame
        return [audio[i, : n * hop].copy() for i, n in enumerate(frames)]

    def synthesize(self, texts: Sequence[str], scales: Sequence[KokoroScales]) -> list[np.ndarray]:
        return synthesize_pieces(self, texts, scales)
