"""Barge-in stop time at the client: from `input_audio_buffer.speech_started` to the
cancelled `response.done`; the audio deltas of cancelled responses that still arrive
after their `response.done` (must be 0), and the response deltas that arrive between
`speech_started` and the cancelled `response.done` (must be 0 too: the cancel is
carried out before anything more of the response reaches the client).

    .venv/bin/python bench/barge_in.py [--url ws://HOST:PORT/v1 | --config PROFILE.yaml]
                                       [--trials 20] [--json]

Without `--url` the gateway is started through its CLI (real models, `--config` passed on).
Each trial, on a session of its own, asks a question answered aloud and, at its first
audio delta, talks over it in real time with a real recording (ALSA's "Front Center").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gateway import RATE, gateway_process, stream_audio  # noqa: E402

RECORDING = Path("/usr/share/sounds/alsa/Front_Center.wav")


def recording_pcm(ms: int = 600) -> bytes:
    data, rate = sf.read(RECORDING, dtype="float32")
    pcm = soxr.resample(data, rate, RATE)[: RATE * ms // 1000]
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class Trials:
    def __init__(self) -> None:
        self.cancel_ms: list[float] = []
        self.cancelled: set[str] = set()
        self.stale = 0
        self.after_speech_started = 0
        self.finished_first = 0

    def see(self, event: dict) -> None:
        if event["type"] == "response.output_audio.delta":
            self.stale += event["response_id"] in self.cancelled


async def next_event(ws: ClientConnection, trials: Trials, timeout: float = 120) -> dict:
    event = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    trials.see(event)
    return event


async def until_event(ws: ClientConnection, trials: Trials, kind: str) -> dict:
    event = await next_event(ws, trials)
    while event["type"] != kind:
        event = await next_event(ws, trials)
    return event


async def quiet(ws: ClientConnection, trials: Trials, seconds: float = 1.0) -> None:
    while True:
        try:
            await next_event(ws, trials, seconds)
        except TimeoutError:
            return


async def until_response_done(ws: ClientConnection, trials: Trials) -> None:
    started = None
    deltas = 0  # response deltas since speech_started
    while True:
        event = await next_event(ws, trials)
        if event["type"] == "input_audio_buffer.speech_started" and started is None:
            started = time.monotonic()
        elif event["type"].startswith("response.") and event["type"].endswith(".delta"):
            deltas += started is not None
        elif event["type"] == "response.done":
            response = event["response"]
            if response["status"] == "cancelled" and started is not None:
                trials.cancel_ms.append((time.monotonic() - started) * 1000)
                trials.cancelled.add(response["id"])
                trials.after_speech_started += deltas
            else:
                trials.finished_first += 1
            return


async def one_trial(ws: ClientConnection, trials: Trials, n: int, speech: bytes) -> None:
    item = {
        "type": "message",
        "role": "user",
        # A long answer: the reply must still be streaming when the VAD hears the speech.
        "content": [{"type": "input_text", "text": f"Tell me a long story about the number {n}."}],
    }
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create"}))
    await until_event(ws, trials, "response.output_audio.delta")
    # Events are read while the speech streams, so each is timed as it arrives; the
    # second of silence after it lets the VAD hear the end of the speech.
    sender = asyncio.create_task(stream_audio(ws, speech + bytes(RATE * 2)))
    try:
        await until_response_done(ws, trials)
    finally:
        await sender
    await quiet(ws, trials)
    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    await quiet(ws, trials, 0.3)


async def run(url: str, count: int) -> dict[str, float]:
    trials = Trials()
    speech = recording_pcm()
    detection = {"type": "server_vad", "silence_duration_ms": 300, "create_response": False}
    session = {
        "type": "realtime",
        "output_modalities": ["audio"],
        "audio": {"input": {"turn_detection": detection}},
    }
    # A session per trial: each question starts from the same empty conversation, so
    # earlier cut-off answers do not shape (or shorten) the next one.
    for n in range(count):
        async with connect(f"{url}/realtime?model=duplex-smollm2", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            await one_trial(ws, trials, n, speech)
    return {
        "trials": count,
        "barge_ins": len(trials.cancel_ms),
        "finished_before_speech": trials.finished_first,
        "cancel_ms_p50": round(percentile(trials.cancel_ms, 50), 1),
        "cancel_ms_p95": round(percentile(trials.cancel_ms, 95), 1),
        "stale_audio_deltas": trials.stale,
        "deltas_after_speech_started": trials.after_speech_started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="gateway ws base URL (default: start one)")
    parser.add_argument("--config", type=Path, help="gateway profile YAML (when started here)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.url and args.config:
        parser.error("--config applies to a gateway started here, not to --url")
    if args.url:
        result = asyncio.run(run(args.url, args.trials))
    else:
        extra = ("--config", str(args.config)) if args.config else ()
        with gateway_process(*extra) as gateway:
            result = asyncio.run(run(gateway.url, args.trials))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
