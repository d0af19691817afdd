"""How long an interruption's words take to transcribe: on an idle engine, beside answers
the LLM is working on, and beside the voice rendering a sentence; asked as the engine
asks them (urgent: the main lane waits, within its steps too; greedy whatever the
profile's beam size) and as plain requests (a final transcript), in the same run; and
how many tokens the answers decoded meanwhile.

    .venv/bin/python bench/interruption_words.py [--config PROFILE.yaml] [--trials 8] [--json]

The words are eSpeak NG's "Hold on, can we talk" behind 300 ms of silence (server VAD's
prefix padding), about what the first check of an interruption hears. Each busy trial
starts two story answers, lets them run for 400 ms (with a large model they are still
prefilling their prompts then), then asks for the words. Each speaking trial gives the
voice a long sentence, waits for its short first piece and 300 ms more (the rest is
rendering then, in one pass of seconds with Kokoro on a CPU), then asks for the words.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
import soxr  # noqa: E402

from engine.build import build_engine  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.llm.stage import LlmInput  # noqa: E402
from engine.runtime.core import AsyncEngine  # noqa: E402
from engine.runtime.request import SamplingParams  # noqa: E402
from engine.stages.asr_request import AsrRequest  # noqa: E402
from engine.stages.tts import TtsRequest  # noqa: E402

RATE = 16000
WORDS = "Hold on, can we talk"
SPOKEN = "The weather should stay mild and sunny for most of the afternoon today, so take a walk."


def words_clip() -> np.ndarray:
    wav = subprocess.run(["espeak-ng", "--stdout", WORDS], capture_output=True, check=True).stdout
    audio, rate = sf.read(io.BytesIO(wav), dtype="float32")
    speech = soxr.resample(audio, rate, RATE).astype(np.float32)[: RATE // 2]
    return np.concatenate([np.zeros(RATE * 3 // 10, np.float32), speech])


async def transcribe(engine_: AsyncEngine, rid: str, clip: np.ndarray, urgent: bool) -> float:
    start = time.perf_counter()
    request = AsrRequest(clip, urgent=urgent, greedy=urgent)
    outputs = [out async for out in engine_.stream("asr", rid, request)]
    elapsed = (time.perf_counter() - start) * 1000
    if outputs[-1].error:
        raise RuntimeError(f"the transcription failed: {outputs[-1].error}")
    return elapsed


async def answer(engine_: AsyncEngine, rid: str, tokens: list[float]) -> None:
    story = [{"role": "user", "content": "Write a long, detailed story about a lighthouse."}]
    inputs = LlmInput(messages=story, sampling_params=SamplingParams(max_tokens=400))
    async for _ in engine_.stream("llm", rid, inputs):
        tokens.append(time.perf_counter())


async def busy_trial(
    engine_: AsyncEngine, n: int, clip: np.ndarray, urgent: bool
) -> tuple[float, int]:
    tokens: list[float] = []
    answers = [asyncio.create_task(answer(engine_, f"a{n}.{k}", tokens)) for k in range(2)]
    await asyncio.sleep(0.4)
    start = time.perf_counter()
    ms = await transcribe(engine_, f"w{n}", clip, urgent)
    decoded = sum(start <= t <= start + ms / 1000 for t in tokens)
    for task in answers:
        task.cancel()
    await asyncio.gather(*answers, return_exceptions=True)
    return ms, decoded


async def speaking_trial(engine_: AsyncEngine, n: int, clip: np.ndarray, urgent: bool) -> float:
    rid = f"s{n}"
    speech = engine_.stream("tts", rid, TtsRequest())
    await engine_.run("tts", lambda stage: stage.feed(rid, SPOKEN, True))
    await speech.__anext__()  # the first piece; the rest of the sentence renders now
    await asyncio.sleep(0.3)
    ms = await transcribe(engine_, f"ws{n}", clip, urgent)
    async for _ in speech:  # the rest of the sentence: the next trial finds the voice idle
        continue
    return ms


async def run(config: str, trials: int) -> dict[str, Any]:
    bundle = await build_engine(load_config(config), progress=False)
    engine_, clip = bundle.engine, words_clip()
    try:
        await transcribe(engine_, "warm", clip, False)
        result: dict[str, Any] = {"trials": trials}
        for urgent in (False, True):
            name = "urgent" if urgent else "plain"
            idle = [await transcribe(engine_, f"i{name}{n}", clip, urgent) for n in range(trials)]
            busy = [await busy_trial(engine_, n, clip, urgent) for n in range(trials)]
            speaking = [await speaking_trial(engine_, n, clip, urgent) for n in range(trials)]
            result[f"{name}_idle_ms_p50"] = round(statistics.median(idle), 1)
            result[f"{name}_busy_ms_p50"] = round(statistics.median(ms for ms, _ in busy), 1)
            result[f"{name}_busy_ms_max"] = round(max(ms for ms, _ in busy), 1)
            result[f"{name}_tokens_decoded_meanwhile"] = sum(d for _, d in busy)
            result[f"{name}_speaking_ms_p50"] = round(statistics.median(speaking), 1)
            result[f"{name}_speaking_ms_max"] = round(max(speaking), 1)
        return result
    finally:
        await bundle.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.config, args.trials))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
