"""Voice-to-voice latency of the whole pipeline (ASR → LLM → TTS) through the stage port.

    python bench/pipeline.py [--config configs/default.yaml] [--questions 12] [--json]

Each question is synthesised once by the engine's own voice (16 kHz), then submitted as
a committed voice turn, one turn at a time, on a warm engine. `first_audio_ms` runs from
the submit (the end of the committed audio) to the first audio chunk reaching the sink;
`first_audio_cpu_ms` is the process CPU time over the same span.
The breakdown comes from the orchestrator's marks: `asr_ms` (submit to transcript),
`llm_first_clause_ms` (LLM start to its first complete clause), `tts_first_chunk_ms`
(that clause to its first audio). After the first audio the turn is aborted, as a
barge-in would, unless `--full-turns` is given.

Each question is also run prepared, as the gateway's server VAD runs it: the turn is
handed to `prepare_turn` `--prepare-lead-ms` before it is submitted (the default, 350
ms, is the 500 ms end-of-turn silence minus the 150 ms pause that starts preparation),
and `prepared_first_audio_ms` runs from the submit as well. Cold and prepared turns
alternate, so both see the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # before anything imports mlx: the optimised BLAS

import numpy as np  # noqa: E402
import soxr  # noqa: E402

from duplex.contracts import (  # noqa: E402
    DuplexFence,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    duplex_ephemeral_stage_request_id,
)
from duplex.outputs import DuplexPreparedTurn, DuplexStageOutput  # noqa: E402
from duplex.turn import Stage, TurnRequest  # noqa: E402
from engine.build import EngineBundle, build_engine  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.runtime import clients  # noqa: E402
from engine.runtime.core import exit_process  # noqa: E402
from engine.stages.tts import TtsRequest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = (
    "What is the capital of France?",
    "How are you doing today?",
    "Can you tell me a short joke?",
    "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?",
    "What is your favorite color?",
    "Why is the sky blue?",
    "What should I cook for dinner tonight?",
    "How far away is the moon?",
    "What is two plus two?",
    "Where do penguins live?",
    "What is the tallest mountain in the world?",
)


async def record(bundle: EngineBundle, text: str, rid: str) -> np.ndarray:
    """The question spoken by the TTS stage, as 16 kHz float audio for the ASR stage."""
    stream = bundle.engine.stream("tts", rid, TtsRequest())
    await clients.tts(bundle.engine).run(lambda tts: tts.feed(rid, text, True))
    chunks = [out.payload async for out in stream]
    audio = np.concatenate([c.samples for c in chunks])
    return soxr.resample(audio, chunks[0].sample_rate, 16000).astype(np.float32)


class Turns:
    """Submits voice turns and times their first audio chunk."""

    def __init__(self, bundle: EngineBundle) -> None:
        self.orch = bundle.orchestrator
        # (wall clock, process CPU time, output) per request id
        self.outputs: dict[str, list[tuple[float, float, DuplexStageOutput]]] = {}
        self.changed = asyncio.Event()
        self.orch.attach_output_sink(self._sink)

    def _sink(self, out: DuplexStageOutput) -> None:
        stamp = (time.perf_counter(), time.process_time(), out)
        self.outputs.setdefault(out.request_id, []).append(stamp)
        self.changed.set()

    async def run(
        self, turn: int, audio: np.ndarray, full: bool, prepare_lead_s: float | None = None
    ) -> dict[str, Any]:
        fence = DuplexFence("bench", 0, turn)
        contexts = [
            DuplexStageRequestContext(
                request_id=duplex_ephemeral_stage_request_id(fence, stage_id=n),
                session_id="bench",
                fence=fence,
                stage_id=n,
                final_stage_id=2,
                config_generation=0,
                sampling_params=self.orch.sampling_defaults(),
            )
            for n in range(3)
        ]
        ids = [c.request_id for c in contexts]
        # One conversation key, as a live session has: its system prompt stays cached.
        request = TurnRequest(
            final=Stage.TTS, audio=audio.astype("<f4").tobytes(), cache_key="bench"
        )
        prompt = request.plan().prompt
        if prepare_lead_s is not None:
            defaults = self.orch.sampling_defaults()
            self.orch.prepare_turn(DuplexPreparedTurn("bench", 0, defaults, prompt, 0, 2))
            await asyncio.sleep(prepare_lead_s)
        for ctx in contexts:
            self.orch.ensure_request(ctx)
        start = (time.perf_counter(), time.process_time())
        await self.orch.submit(DuplexStageSubmission(contexts[0], prompt, False, False))
        first = await self._wait(ids, full)
        await self.orch.cleanup(ids, abort=True)
        return _measure(start, first, self.outputs.get(ids[0], []))

    async def _wait(
        self, ids: list[str], full: bool
    ) -> tuple[float, float, DuplexStageOutput] | None:
        while True:
            errors = [o for rid in ids for *_, o in self.outputs.get(rid, ()) if o.kind == "error"]
            if errors:
                raise RuntimeError(f"turn failed: {errors[0].metadata.get('error')}")
            audio = [row for row in self.outputs.get(ids[2], []) if row[2].kind == "audio"]
            finished = any(o.finished for *_, o in self.outputs.get(ids[2], ()))
            if (audio and not full) or finished:
                return audio[0] if audio else None
            self.changed.clear()
            await self.changed.wait()


def _measure(
    start: tuple[float, float],
    first: tuple[float, float, DuplexStageOutput] | None,
    asr: list[tuple[float, float, DuplexStageOutput]],
) -> dict[str, Any]:
    transcript = next((o for *_, o in asr if o.kind == "transcript"), None)
    row: dict[str, Any] = {
        "transcript": transcript.text if transcript else None,
        "asr_ms": transcript.metadata.get("asr_ms") if transcript else None,
    }
    if first is not None:
        at, cpu_at, out = first
        row.update(
            first_audio_ms=(at - start[0]) * 1000.0,
            first_audio_cpu_ms=(cpu_at - start[1]) * 1000.0,
            llm_first_clause_ms=out.metadata.get("llm_first_clause_ms"),
            tts_first_chunk_ms=out.metadata.get("tts_first_chunk_ms"),
            first_text=out.text,
        )
    return row


def _pct(rows: list[dict[str, Any]], key: str, q: float) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(float(np.percentile(values, q)), 1) if values else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config(args.config)
    bundle = await build_engine(config, progress=not args.json)
    try:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.questions)]
        audios = [await record(bundle, q, f"record-{i}") for i, q in enumerate(questions)]
        turns = Turns(bundle)
        await turns.run(0, audios[0], args.full_turns)  # warm: not measured
        rows, prepared = [], []
        lead = args.prepare_lead_ms / 1000
        wall, cpu = time.perf_counter(), time.process_time()
        for i, audio in enumerate(audios, 1):
            rows.append(await turns.run(2 * i - 1, audio, args.full_turns))
            if not args.json:
                print(json.dumps(rows[-1]), file=sys.stderr)
            if args.prepare_lead_ms >= 0:
                prepared.append(await turns.run(2 * i, audio, args.full_turns, lead))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await bundle.aclose()
    return {
        "first_audio_ms_p50": _pct(rows, "first_audio_ms", 50),
        "first_audio_ms_p95": _pct(rows, "first_audio_ms", 95),
        # CPU time the process spent from submit to first audio: roughly what the wall
        # time would be on an idle machine, since the engine thread does the work in turn.
        "first_audio_cpu_ms_p50": _pct(rows, "first_audio_cpu_ms", 50),
        "asr_ms_p50": _pct(rows, "asr_ms", 50),
        "llm_first_clause_ms_p50": _pct(rows, "llm_first_clause_ms", 50),
        "tts_first_chunk_ms_p50": _pct(rows, "tts_first_chunk_ms", 50),
        "prepared_first_audio_ms_p50": _pct(prepared, "first_audio_ms", 50),
        "prepared_first_audio_ms_p95": _pct(prepared, "first_audio_ms", 95),
        "prepare_lead_ms": args.prepare_lead_ms,
        "turns": len(rows),
        "turns_with_audio": sum(r.get("first_audio_ms") is not None for r in rows),
        "questions": len(set(questions)),
        # How contended the machine was: CPU this process got per second of turns, and
        # the 1-minute load average (a 2-core machine with load 8 gives ~1/4 of a core).
        "process_cpu_per_wall_s": round(cpu / wall, 2),
        "load_average_1m": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--full-turns", action="store_true", help="let each turn finish")
    parser.add_argument(
        "--prepare-lead-ms",
        type=int,
        default=350,
        help="how long before its submit a prepared turn starts (negative: no prepared runs)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>26}: {value}")


if __name__ == "__main__":
    main()
    exit_process(0)
