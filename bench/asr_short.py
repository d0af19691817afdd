"""Short spoken commands (under 1.5 s): does the trimmed encoder transcribe them as
Whisper's full 30 s window does?

Clips: the ALSA test recordings under 1.5 s (a person speaking), and commands spoken by
eSpeak NG (two accents) and by the engine's own voice. Each clip is transcribed by the
engine's transcriber (trimmed window), by the same weights with the full window, and by
the trimmed transcriber without the minimum first window (`min_window_s=0`: utterance +
1 s, the setting that misheard last words). Two transcripts agree when their words match
(case and punctuation aside).

    python bench/asr_short.py [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
import soxr  # noqa: E402

from engine.stages.asr import Transcriber, load_transcriber  # noqa: E402
from engine.weights import registry  # noqa: E402

RATE = 16000
MAX_S = 1.49
ALSA = Path("/usr/share/sounds/alsa")
ALSA_CLIPS = ["Front_Center", "Front_Left", "Rear_Center", "Rear_Left", "Side_Left", "Side_Right"]
ESPEAK_CLIPS = [
    ("Stop.", "en-us"),
    ("Turn it off.", "en-gb"),
    ("Yes please.", "en-us"),
    ("What time is it?", "en-us"),
    ("Thank you.", "en-gb"),
    ("Good morning.", "en-gb"),
    ("Play some music.", "en-us"),
    ("Open the door.", "en-us"),
    ("Call mom.", "en-gb"),
    ("Call mom.", "en-gb-x-rp"),
    ("Next song.", "en-us"),
]
VOICE_CLIPS = ["Pause the music.", "Volume up.", "Cancel that.", "Lights on."]


def _resampled(audio: np.ndarray, rate: int) -> np.ndarray:
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    return soxr.resample(audio, rate, RATE).astype(np.float32)[: int(MAX_S * RATE)]


def _espeak(text: str, voice: str) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", "175", "-w", str(wav), text], check=True)
        audio, rate = sf.read(str(wav), dtype="float32")
    return _resampled(audio, rate)


def short_clips(*, with_voice: bool = True) -> list[tuple[str, np.ndarray]]:
    """(name, 16 kHz audio under 1.5 s) for every clip of the set."""
    clips = []
    for name in ALSA_CLIPS:
        audio, rate = sf.read(str(ALSA / f"{name}.wav"), dtype="float32")
        clips.append((name.replace("_", " "), _resampled(audio, rate)))
    clips += [(f"{text} ({voice})", _espeak(text, voice)) for text, voice in ESPEAK_CLIPS]
    if with_voice:
        from engine.stages.tts import Synthesizer, load_voice

        synth = Synthesizer(load_voice())
        for text in VOICE_CLIPS:
            chunk = synth.synthesize(text)
            clips.append((f"{text} (engine voice)", _resampled(chunk.samples, chunk.sample_rate)))
    return clips


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def transcripts(transcriber: Transcriber, clips: list[tuple[str, np.ndarray]]) -> list[str]:
    return [r.text for r in transcriber.transcribe_batch([audio for _, audio in clips])]


def compare(model_dir: Path, clips: list[tuple[str, np.ndarray]]) -> dict:
    """Transcripts of every clip by the three transcribers, and the agreement counts."""
    trimmed = transcripts(load_transcriber(model_dir), clips)
    full = transcripts(load_transcriber(model_dir, pad_s=30.0, fallback_pad_s=30.0), clips)
    plain = transcripts(load_transcriber(model_dir, min_window_s=0.0), clips)
    rows = [
        {"clip": name, "seconds": round(len(audio) / RATE, 2), "trimmed": t, "full": f, "plain": p}
        for (name, audio), t, f, p in zip(clips, trimmed, full, plain, strict=True)
    ]
    return {
        "clips": len(clips),
        "agree": sum(words(t) == words(f) for t, f in zip(trimmed, full, strict=True)),
        "agree_without_min_window": sum(
            words(p) == words(f) for p, f in zip(plain, full, strict=True)
        ),
        "transcripts": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = compare(registry.prepare("whisper-tiny.en", progress=not args.json), short_clips())
    if args.json:
        print(json.dumps(result))
        return
    for r in result["transcripts"]:
        same = "=" if words(r["trimmed"]) == words(r["full"]) else "≠"
        print(f"{r['clip']:<34}{r['seconds']:>5} s  {same} {r['trimmed']!r} / full {r['full']!r}")
    print(
        f"trimmed agrees with the full window on {result['agree']} of {result['clips']} "
        f"(without the minimum window: {result['agree_without_min_window']})"
    )


if __name__ == "__main__":
    main()
