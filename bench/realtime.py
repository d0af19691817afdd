"""Voice-to-voice latency at the client: from `input_audio_buffer.speech_stopped` to the
first `response.output_audio.delta`, over spoken questions sent in real time.

    .venv/bin/python bench/realtime.py [--url ws://HOST:PORT/v1] [--questions 10] [--json]

Without `--url` the gateway is started through its CLI (real models) on a free port.
The questions are spoken by eSpeak NG (the `espeak-ng` program), a voice independent
of the gateway's own TTS.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parent.parent
RATE = 24000
CHUNK_MS = 100
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


@contextmanager
def gateway_process(log_level: str = "WARNING") -> Iterator[str]:
    """`duplex-gateway` in a subprocess on a free port; yields its ws base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "gateway.cli", "--port", str(port), "--log-level", log_level]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            break
    else:
        raise RuntimeError(f"gateway exited with {proc.wait()}")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    try:
        yield f"ws://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(60)


def spoken(text: str) -> bytes:
    """PCM16 24 kHz of `text` spoken by eSpeak NG."""
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        subprocess.run(["espeak-ng", "-w", wav.name, text], check=True)
        data, rate = sf.read(wav.name, dtype="float32")
    pcm = soxr.resample(data, rate, RATE)
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


async def stream_audio(ws: object, pcm: bytes) -> None:
    """Append `pcm` in 100 ms chunks at real-time pace, as a microphone would."""
    step = RATE * 2 * CHUNK_MS // 1000
    start = time.monotonic()
    for n, i in enumerate(range(0, len(pcm), step)):
        chunk = base64.b64encode(pcm[i : i + step]).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        await asyncio.sleep(max(0.0, start + (n + 1) * CHUNK_MS / 1000 - time.monotonic()))


async def one_question(ws: object, pcm: bytes) -> float:
    """Milliseconds from speech_stopped to the first audio delta of the answer."""
    sender = asyncio.create_task(stream_audio(ws, pcm + bytes(RATE * 2 * 12 // 10)))
    stopped_at = None
    first_ms = None
    try:
        async with asyncio.timeout(120):
            while True:
                event = json.loads(await ws.recv())
                kind = event["type"]
                if kind == "input_audio_buffer.speech_stopped" and stopped_at is None:
                    stopped_at = time.monotonic()
                elif kind == "response.output_audio.delta" and first_ms is None:
                    first_ms = (time.monotonic() - (stopped_at or time.monotonic())) * 1000
                elif kind == "response.done":
                    break
                elif kind == "error":
                    raise RuntimeError(event["error"]["message"])
    finally:
        await sender
    if first_ms is None:
        raise RuntimeError("the answer had no audio")
    return first_ms


async def run(url: str, count: int) -> dict[str, float]:
    questions = [spoken(q) for q in (QUESTIONS * 2)[:count]]
    latencies = []
    async with connect(f"{url}/realtime?model=duplex-smollm2", max_size=None) as ws:
        await ws.recv()  # session.created
        session = {
            "type": "realtime",
            "output_modalities": ["audio"],
            "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
        }
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        for pcm in questions:
            latencies.append(await one_question(ws, pcm))
    return {
        "questions": len(latencies),
        "first_audio_ms_p50": round(percentile(latencies, 50), 1),
        "first_audio_ms_p95": round(percentile(latencies, 95), 1),
        "first_audio_ms_max": round(max(latencies), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="gateway ws base URL (default: start one)")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.url:
        result = asyncio.run(run(args.url, args.questions))
    else:
        with gateway_process() as url:
            result = asyncio.run(run(url, args.questions))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
