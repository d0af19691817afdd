"""Whisper tiny.en speed: wall time and real-time factor of the engine's transcriber on
a 2 s, a 3 s and a 10 s utterance (eSpeak NG speech), and on the 2 s one with the encoder
forced to Whisper's full 30 s window. `wall_ms_3s` is what a turn waits for after its
speech ends when none of it was transcribed before (the target: 60 ms or less).
`wall_ms_2s_sgemm` is the 2 s utterance with few-row products through plain sgemm instead
of the forwarder's kernels (`engine.native.gemv_forward` off), timed interleaved with
`wall_ms_2s`.

    python bench/asr.py [--repeats 5] [--json]

No CTranslate2 anchor is run: ctranslate2 is not a dependency of the project.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
import soxr  # noqa: E402

from engine.native import gemv_forward  # noqa: E402
from engine.stages.asr import Transcriber, load_transcriber  # noqa: E402
from engine.weights import registry  # noqa: E402

RATE = 16000
SHORT = "Open the window, please."
MEDIUM = "Can you remind me to call my mother tomorrow?"
LONG = (
    "The children played in the park until the sun went down. "
    "Can you remind me to call my mother tomorrow morning? "
    "The meeting has been moved to Monday afternoon."
)


def speak(text: str, seconds: float) -> np.ndarray:
    """eSpeak NG speech of `text`, 16 kHz, padded with silence (or cut) to `seconds`."""
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), text], check=True)
        audio, rate = sf.read(str(wav), dtype="float32")
    audio = soxr.resample(audio, rate, RATE).astype(np.float32)
    n = int(seconds * RATE)
    return np.pad(audio, (0, max(0, n - len(audio))))[:n]


def time_ms(transcriber: Transcriber, audio: np.ndarray, repeats: int) -> tuple[float, str]:
    """Median wall time of `transcribe` (after one warm-up run) and the transcript."""
    text = transcriber.transcribe(audio)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        transcriber.transcribe(audio)
        runs.append((time.perf_counter() - start) * 1000)
    return statistics.median(runs), text


def forwarding_ab_ms(model_dir: Path, audio: np.ndarray, repeats: int) -> tuple[float, float]:
    """Median wall time of `transcribe` with few-row products through the forwarder
    (the engine's default) and through plain sgemm, alternating runs so that both see
    the same load."""
    transcriber = load_transcriber(model_dir)
    runs: dict[bool, list[float]] = {True: [], False: []}
    transcriber.transcribe(audio)
    for _ in range(repeats):
        for on in (True, False):
            gemv_forward.enable(on)
            start = time.perf_counter()
            transcriber.transcribe(audio)
            runs[on].append((time.perf_counter() - start) * 1000)
    gemv_forward.enable(True)
    return statistics.median(runs[True]), statistics.median(runs[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    model_dir = registry.prepare("whisper-tiny.en", progress=not args.json)
    trimmed = load_transcriber(model_dir)
    full = load_transcriber(model_dir, pad_s=30.0, fallback_pad_s=30.0)
    short, medium, long = speak(SHORT, 2.0), speak(MEDIUM, 3.0), speak(LONG, 10.0)

    if gemv_forward.is_active():
        ms_2s, ms_2s_sgemm = forwarding_ab_ms(model_dir, short, args.repeats)
    else:
        ms_2s = ms_2s_sgemm = time_ms(trimmed, short, args.repeats)[0]
    text_2s = trimmed.transcribe(short)
    ms_3s, text_3s = time_ms(trimmed, medium, args.repeats)
    ms_10s, text_10s = time_ms(trimmed, long, args.repeats)
    ms_full, text_full = time_ms(full, short, args.repeats)
    result = {
        "wall_ms_2s": round(ms_2s, 1),
        "wall_ms_2s_sgemm": round(ms_2s_sgemm, 1),
        "wall_ms_3s": round(ms_3s, 1),
        "rtf_2s": round(ms_2s / 2000, 3),
        "rtf_10s": round(ms_10s / 10000, 3),
        "rtf_2s_full_window": round(ms_full / 2000, 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    rows = [
        ("2 s, trimmed encoder", ms_2s, 2.0, text_2s),
        ("3 s, trimmed encoder", ms_3s, 3.0, text_3s),
        ("10 s, trimmed encoder", ms_10s, 10.0, text_10s),
        ("2 s, full 30 s window", ms_full, 2.0, text_full),
    ]
    print(f"{'utterance':<24}{'wall ms':>10}{'RTF':>8}  transcript")
    for name, ms, seconds, text in rows:
        print(f"{name:<24}{ms:>10.1f}{ms / seconds / 1000:>8.3f}  {text}")
    print(f"speed-up of trimming on 2 s: {ms_full / ms_2s:.1f}x  (target: 2 s <= 300 ms wall)")


if __name__ == "__main__":
    main()
