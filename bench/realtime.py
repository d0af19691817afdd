"""Voice-to-voice latency at the client: from `input_audio_buffer.speech_stopped` to the
first `response.output_audio.delta`, over spoken questions sent in real time.

    .venv/bin/python bench/realtime.py [--url ws://HOST:PORT/v1] [--config PROFILE]
        [--questions 10] [--baseline] [--json]

Without `--url` the gateway is started through its CLI (real models) on a free port.
The questions are spoken by eSpeak NG (the `espeak-ng` program), a voice independent
of the gateway's own TTS, each followed by 1.2 s of silence. Also printed: the time from
the end of the spoken words to the first audio (what the speaker waits, server-VAD
silence included), and how many prepared responses the gateway adopted and discarded
(/metrics). `--baseline` runs a second gateway with prepared responses off, in the same
run, for the `*_unprepared` figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
import yaml
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gateway import RATE, gateway_process, stream_audio  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
    "Can you name a fruit that is yellow?",
    "What do bees make?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Which animal says moo?",
    "What do you call frozen water?",
    "What is two plus three?",
    "Where does the sun rise?",
    "What is the largest ocean on Earth?",
]
TRAILING_SILENCE_S = 1.2


def spoken(text: str) -> bytes:
    """PCM16 24 kHz of `text` spoken by eSpeak NG."""
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        subprocess.run(["espeak-ng", "-w", wav.name, text], check=True)
        data, rate = sf.read(wav.name, dtype="float32")
    pcm = soxr.resample(data, rate, RATE)
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class Turn:
    """One question's timings at the client, all in milliseconds."""

    def __init__(self) -> None:
        self.first_audio_ms: float | None = None  # from speech_stopped
        self.from_speech_end_ms: float | None = None  # from the end of the spoken words


async def one_question(ws: ClientConnection, pcm: bytes, clock_ms: float) -> Turn:
    """Send one spoken question at real-time pace (`clock_ms`: the session's audio clock
    when it starts) and time its answer's first audio."""
    silence = bytes(int(RATE * 2 * TRAILING_SILENCE_S))
    sent_at = time.monotonic()
    sender = asyncio.create_task(stream_audio(ws, pcm + silence))
    try:
        turn = await asyncio.wait_for(time_answer(ws, sent_at, clock_ms), 120)
    finally:
        await sender
    if turn.first_audio_ms is None:
        raise RuntimeError("the answer had no audio")
    return turn


async def time_answer(ws: ClientConnection, sent_at: float, clock_ms: float) -> Turn:
    """Read events until the answer is done, timing its first audio."""
    turn = Turn()
    stopped_at: float | None = None
    speech_end_at: float | None = None
    while True:
        event = json.loads(await ws.recv())
        kind = event["type"]
        now = time.monotonic()
        if kind == "input_audio_buffer.speech_stopped" and stopped_at is None:
            stopped_at = now
            # The audio at session time audio_end_ms left this client then.
            speech_end_at = sent_at + (event["audio_end_ms"] - clock_ms) / 1000
        elif kind == "response.output_audio.delta" and turn.first_audio_ms is None:
            turn.first_audio_ms = (now - (stopped_at or now)) * 1000
            turn.from_speech_end_ms = (now - (speech_end_at or now)) * 1000
        elif kind == "response.done":
            return turn
        elif kind == "error":
            raise RuntimeError(event["error"]["message"])


async def run(url: str, count: int) -> dict[str, float]:
    questions = [spoken(q) for q in (QUESTIONS * 2)[:count]]
    turns = []
    clock_ms = 0.0
    async with connect(f"{url}/realtime?model=duplex-smollm2", max_size=None) as ws:
        await ws.recv()  # session.created
        session = {
            "type": "realtime",
            "output_modalities": ["audio"],
            "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
        }
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        for pcm in questions:
            turns.append(await one_question(ws, pcm, clock_ms))
            clock_ms += (len(pcm) / 2 / RATE + TRAILING_SILENCE_S) * 1000
    first = [t.first_audio_ms for t in turns if t.first_audio_ms is not None]
    heard = [t.from_speech_end_ms for t in turns if t.from_speech_end_ms is not None]
    return {
        "questions": len(turns),
        "first_audio_ms_p50": round(percentile(first, 50), 1),
        "first_audio_ms_p95": round(percentile(first, 95), 1),
        "first_audio_ms_max": round(max(first), 1),
        # What the speaker waits: the server-VAD silence plus the answer's latency.
        "speech_end_to_first_audio_ms_p50": round(percentile(heard, 50), 1),
    }


def prepared_counts(port: int) -> dict[str, int]:
    """Prepared responses by outcome, from the gateway's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    prefix = "duplex_gateway_prepared_responses_total{outcome="
    return {
        line[len(prefix) + 1 : line.index("}") - 1]: int(float(line.split()[-1]))
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def measure(config: Path, count: int) -> dict[str, float]:
    with gateway_process("--config", str(config)) as gw:
        result = asyncio.run(run(gw.url, count))
        counts = prepared_counts(gw.port)
    result["prepared_adopted"] = counts.get("adopted", 0)
    result["prepared_discarded"] = counts.get("discarded", 0)
    return result


def unprepared_profile(config: Path, folder: Path) -> Path:
    """`config` with prepared responses turned off."""
    profile = yaml.safe_load(config.read_text()) or {}
    profile.setdefault("gateway", {})
    profile["gateway"] = {**(profile["gateway"] or {}), "prepare_after_silence_ms": None}
    path = folder / "unprepared.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="gateway ws base URL (default: start one)")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also run a gateway with prepared responses off (fields *_unprepared)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.url:
        result = asyncio.run(run(args.url, args.questions))
    else:
        result = measure(args.config, args.questions)
        if args.baseline:
            with tempfile.TemporaryDirectory() as folder:
                base = measure(unprepared_profile(args.config, Path(folder)), args.questions)
            for key in ("first_audio_ms_p50", "first_audio_ms_p95"):
                result[f"{key}_unprepared"] = base[key]
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>34}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
