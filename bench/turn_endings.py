"""How sure Whisper is of how a turn's words end: phrases cut in mid-sentence against
whole sentences, as `semantic_vad`'s word check sees them (docs/protocol.md, "Turn
detection").

    python bench/turn_endings.py [--json]

Clips: `bench/turns.py`'s hesitation sentences, each cut 160 ms into its 900 ms
hesitation (where the gateway first scores the turn), and its whole sentences with 160 ms
of the silence after them; both voices; 300 ms of silence in front, as VAD's padding.
Each is transcribed once by whisper-tiny.en with token log-probabilities, in-process.

- `cut_held`: cut phrases the word check holds (`sounds_unfinished` or `sounds_unsure`):
  the turn is not ended in the hesitation.
- `cut_held_by_sureness`: of those, the ones only the doubt about the ending holds (an
  unsure last token, no stop after it, or a stop at even odds or less).
- `whole_held`: whole sentences held all the same; they wait for the eagerness's cap.
- `transcripts`: each clip's transcript and its last three tokens' log-probabilities.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import engine  # noqa: E402

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too

import numpy as np  # noqa: E402
import soxr  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import turns  # noqa: E402  (its clips)

from engine.listening.turn_words import ENDING_TOKENS, sounds_unfinished, sounds_unsure  # noqa: E402
from engine.stages.asr import AsrRequest, Transcriber, load_transcriber  # noqa: E402
from engine.weights import registry  # noqa: E402

SAMPLE_RATE = 16000
SCORED_AFTER_S = 0.16  # semantic_score_after_ms in configs/default.yaml
PADDING_S = 0.3
LOUD = 0.02


def _audio(pcm: bytes) -> np.ndarray:
    samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
    return soxr.resample(samples, turns.RATE, SAMPLE_RATE).astype(np.float32)


def _turn(audio: np.ndarray, end: int) -> np.ndarray:
    """The turn as the gateway scores it: padding, speech, then the silence so far."""
    padding = np.zeros(int(PADDING_S * SAMPLE_RATE), np.float32)
    silence = np.zeros(max(0, end - len(audio)), np.float32)
    return np.concatenate([padding, audio[:end], silence])


def cut_phrases() -> list[np.ndarray]:
    out = []
    for text in turns.HESITATIONS:
        for voice in turns.VOICES:
            audio = _audio(turns.speak(text, voice))
            loud = np.flatnonzero(np.abs(audio) > LOUD)
            gap = int(np.argmax(np.diff(loud)))  # the hesitation: the longest quiet run
            out.append(_turn(audio, loud[gap] + int(SCORED_AFTER_S * SAMPLE_RATE)))
    return out


def whole_sentences() -> list[np.ndarray]:
    out = []
    for text in turns.SENTENCES:
        for voice in turns.VOICES:
            audio = _audio(turns.speak(text, voice))
            last = np.flatnonzero(np.abs(audio) > LOUD)[-1]
            out.append(_turn(audio, last + int(SCORED_AFTER_S * SAMPLE_RATE)))
    return out


def check(transcriber: Transcriber, clips: list[np.ndarray]) -> list[dict[str, Any]]:
    requests = [AsrRequest(clip, logprobs=True) for clip in clips]
    out = []
    for heard in transcriber.transcribe_requests(requests):
        unfinished, unsure = (
            sounds_unfinished(heard.text),
            sounds_unsure(heard.text, heard.logprobs),
        )
        out.append(
            {
                "text": heard.text,
                "ending_logprobs": [round(p, 2) for p in heard.logprobs[-ENDING_TOKENS:]],
                "unfinished": unfinished,
                "unsure": unsure,
                "held": unfinished or unsure,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    transcriber = load_transcriber(registry.prepare("whisper-tiny.en", progress=not args.json))
    cut, whole = check(transcriber, cut_phrases()), check(transcriber, whole_sentences())
    result = {
        "cut_phrases": len(cut),
        "cut_held": sum(c["held"] for c in cut),
        "cut_held_by_sureness": sum(c["unsure"] and not c["unfinished"] for c in cut),
        "whole_sentences": len(whole),
        "whole_held": sum(c["held"] for c in whole),
        "transcripts": {"cut": cut, "whole": whole},
    }
    if args.json:
        print(json.dumps(result))
        return
    for kind in ("cut", "whole"):
        for c in result["transcripts"][kind]:
            mark = "held" if c["held"] else "ends"
            print(f"{kind:5} {mark:4} {c['ending_logprobs']} {c['text']!r}")
    summary = {k: v for k, v in result.items() if k != "transcripts"}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
