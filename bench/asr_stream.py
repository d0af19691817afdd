"""Cost and latency of live transcription: N streams of speech, paced in real time, each
transcribed while it is spoken (`LiveTranscript`, LocalAgreement-2) by one `AsrStage` on
its own engine thread, as the engine runs it (partials of several streams batched, final
requests first).

Each stream speaks `--utterances` eSpeak NG sentences with a pause between; every
`--interval-ms` of new audio it asks for a partial transcript (none while one is in
flight), and at the end of each utterance for the final one. Then, on the idle engine,
each utterance is transcribed whole, as it was before live transcription.

    python bench/asr_stream.py [--streams 8] [--interval-ms 500] [--json]

- `cpu_s_per_speech_s`: process CPU seconds per second of speech, per stream (all ASR
  work, partial and final, included; the machine's other load is not).
- `asr_busy`: fraction of the wall time the ASR thread was transcribing; under 1 the
  streams are sustained in real time.
- `partial_ms_p50/p95`: from a partial request to its result (queueing included).
- `first_delta_ms_p50`: from an utterance's first audio to its first committed words.
- `final_ms_p50/p95`: from the end of an utterance's audio to its final transcript;
  `final_step_ms_p50`: the stage step that decoded the tail (the rest of `final_ms` is
  waiting for the step in progress, and for other finals);
  `whole_ms_p50`: transcribing the same utterance whole, on the idle engine.
- `final_wer`, `whole_wer`: word error rates against the sentences spoken;
  `deltas_exact`: utterances whose deltas concatenate exactly to their final transcript.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
import soxr  # noqa: E402

from engine.listening.live_transcript import LiveTranscript  # noqa: E402
from engine.runtime import clients  # noqa: E402
from engine.runtime.core import AsyncEngine  # noqa: E402
from engine.runtime.lanes import EngineLanes  # noqa: E402
from engine.stages.asr import AsrRequest, AsrStage, Transcription, load_transcriber  # noqa: E402
from engine.weights import registry  # noqa: E402

RATE = 16000
FRAME = RATE // 50  # audio arrives 20 ms at a time
PAUSE_S = 0.6
SENTENCES = [
    "Can you remind me to call my mother tomorrow morning?",
    "How many people live in New York City?",
    "The children played in the park until the sun went down.",
    "My phone is on the kitchen table.",
    "We are going to the beach this weekend.",
    "Thank you very much for your help.",
    "The meeting has been moved to Monday afternoon.",
    "It is raining outside, so take an umbrella.",
    "She likes to walk her dog in the morning.",
    "Please turn off the lights in the living room.",
]


def speak(text: str) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(wav), text], check=True)
        audio, rate = sf.read(str(wav), dtype="float32")
    return soxr.resample(audio, rate, RATE).astype(np.float32)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def word_errors(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[:], i
        for j, h in enumerate(hyp, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (r != h))
    return row[-1]


def wer(refs: list[str], hyps: list[str]) -> float:
    errors = sum(word_errors(words(r), words(h)) for r, h in zip(refs, hyps, strict=True))
    return errors / sum(len(words(r)) for r in refs)


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1) if values else float("nan")


@dataclass
class Utterance:
    sentence: str
    audio: np.ndarray
    final: str = ""
    exact: bool = False
    first_delta_ms: float | None = None
    final_ms: float = 0.0
    final_step_ms: float = 0.0
    partial_ms: list[float] = field(default_factory=list)


class Streams:
    """Runs the live streams against one ASR engine thread."""

    def __init__(self, engine: AsyncEngine, interval_s: float) -> None:
        self.engine = engine
        self.interval = int(interval_s * RATE)
        self.ids = count()

    async def transcribe(self, request: AsrRequest) -> Transcription:
        return (await self.transcribe_timed(request))[0]

    async def transcribe_timed(self, request: AsrRequest) -> tuple[Transcription, float]:
        """The transcript, and the wall time of the stage step that made it (ms)."""
        async for out in self.engine.stream("asr", f"r{next(self.ids)}", request):
            if out.error is not None:
                raise RuntimeError(out.error)
            return out.payload, out.metrics["asr_ms"]
        raise RuntimeError("no output")

    async def stream(self, utterances: list[Utterance], start_delay_s: float) -> None:
        await asyncio.sleep(start_delay_s)
        for utterance in utterances:
            await self.live(utterance)
            await asyncio.sleep(PAUSE_S)

    async def live(self, u: Utterance) -> None:
        live = await clients.asr(self.engine).run(lambda asr: asr.new_live_transcript())
        started = time.perf_counter()
        texts: list[str] = []
        in_flight: asyncio.Task | None = None
        asked_at = 0
        for end in range(FRAME, len(u.audio) + FRAME, FRAME):
            # Real time: frame `end` arrives `end` samples after the utterance began.
            await asyncio.sleep(max(0.0, started + end / RATE - time.perf_counter()))
            if in_flight is None and end - asked_at >= self.interval:
                asked_at = end
                request = live.request(u.audio[:end], final=False)
                in_flight = asyncio.create_task(self.partial(live, u, request, started, texts))
            if in_flight is not None and in_flight.done():
                in_flight.result()
                in_flight = None
        stopped = time.perf_counter()
        result, u.final_step_ms = await self.transcribe_timed(live.request(u.audio, final=True))
        last = live.finish(result)
        u.final_ms = (time.perf_counter() - stopped) * 1000
        if in_flight is not None:
            await in_flight  # its result is dropped: the transcript is frozen
        u.final = live.text + last.text
        u.exact = "".join([*texts, last.text]) == u.final
        if u.first_delta_ms is None and last.text:
            u.first_delta_ms = (time.perf_counter() - started) * 1000

    async def partial(
        self,
        live: LiveTranscript,
        u: Utterance,
        request: AsrRequest,
        started: float,
        texts: list[str],
    ) -> None:
        asked = time.perf_counter()
        result = await self.transcribe(request)
        u.partial_ms.append((time.perf_counter() - asked) * 1000)
        delta = live.agree(result)
        if delta is not None:
            texts.append(delta.text)
            if u.first_delta_ms is None:
                u.first_delta_ms = (time.perf_counter() - started) * 1000


class TimedStage(AsrStage):
    """The ASR stage, adding up the wall time of its steps."""

    busy_s = 0.0

    def step(self):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return super().step()
        finally:
            self.busy_s += time.perf_counter() - start


async def run(args: argparse.Namespace) -> dict:
    model_dir = registry.prepare("whisper-tiny.en", progress=not args.json)
    stage = TimedStage(load_transcriber(model_dir), max_partial_batch=args.partial_batch)
    stage.add("warmup", AsrRequest(np.zeros(RATE, np.float32)))
    stage.step()
    core = EngineLanes({"asr": {"asr": stage}})
    core.start()
    engine = AsyncEngine(core)
    clips = {s: speak(s) for s in SENTENCES}
    plan = [
        [Utterance(s, clips[s]) for s in np.roll(SENTENCES, -3 * i)[: args.utterances]]
        for i in range(args.streams)
    ]
    streams = Streams(engine, args.interval_ms / 1000)
    stage.busy_s = 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    # Streams start out of step, as sessions do.
    await asyncio.gather(*(streams.stream(p, 0.25 * i) for i, p in enumerate(plan)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    busy = stage.busy_s
    utterances = [u for p in plan for u in p]
    whole_ms, whole = [], []
    for u in utterances:
        start = time.perf_counter()
        whole.append((await streams.transcribe(AsrRequest(u.audio))).text)
        whole_ms.append((time.perf_counter() - start) * 1000)
    await asyncio.to_thread(core.shutdown)
    speech_s = sum(len(u.audio) for u in utterances) / RATE
    refs = [u.sentence for u in utterances]
    first = [u.first_delta_ms for u in utterances if u.first_delta_ms is not None]
    return {
        "streams": args.streams,
        "interval_ms": args.interval_ms,
        "utterances": len(utterances),
        "speech_s": round(speech_s, 1),
        "wall_s": round(wall, 1),
        "cpu_s_per_speech_s": round(cpu / speech_s, 3),
        "asr_busy": round(busy / wall, 2),
        "partial_ms_p50": pct([m for u in utterances for m in u.partial_ms], 50),
        "partial_ms_p95": pct([m for u in utterances for m in u.partial_ms], 95),
        "first_delta_ms_p50": pct(first, 50),
        "final_ms_p50": pct([u.final_ms for u in utterances], 50),
        "final_ms_p95": pct([u.final_ms for u in utterances], 95),
        "final_step_ms_p50": pct([u.final_step_ms for u in utterances], 50),
        "whole_ms_p50": pct(whole_ms, 50),
        "final_wer": round(wer(refs, [u.final for u in utterances]), 3),
        "whole_wer": round(wer(refs, whole), 3),
        "deltas_exact": sum(u.exact for u in utterances),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--utterances", type=int, default=3, help="per stream")
    parser.add_argument("--interval-ms", type=int, default=500)
    parser.add_argument("--partial-batch", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:<22}{value}")


if __name__ == "__main__":
    main()
