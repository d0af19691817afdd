"""Smart Turn v3.2: milliseconds per turn-end score of this engine's port and of
onnxruntime with pipecat's own ONNX file, in the same run, batch 1 and batch 8.

`ms_batch1` and `ms_batch8` are the port as the engine runs it: its encoder through the
native kernels on the CPU (`engine.native.kernels`, where they build); `mlx_ms_batch*`
the same port on MLX's operations alone, timed alternating with it.
`mlx_float32_products_ms_batch1` times the model's matrix products and convolutions
alone, on MLX in float32 (as the port computes its exact integer sums).
`onnxruntime_ms_batch*` runs one thread, as pipecat does; `onnxruntime_2_threads_ms_batch1`
two, the cores the port's kernels use here.

    .venv/bin/python bench/smart_turn.py [--repeats 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too

import numpy as np  # noqa: E402

from engine.models import smart_turn  # noqa: E402
from engine.stages.turn_end import TurnEndModel  # noqa: E402
from engine.weights import registry  # noqa: E402


def timed_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return round(float(np.median(times)), 1)


def alternating_ms(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall times of `runs`, one of each in turn, so that all see the same load."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm-up
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: round(float(np.median(t)), 1) for name, t in times.items()}


def float32_products() -> Callable[[], object]:
    """The encoder's products at batch 1, with random operands of the model's shapes."""
    import mlx.core as mx

    frames, d, heads = smart_turn.N_FRAMES // 2, smart_turn.D_MODEL, smart_turn.N_HEADS
    r = mx.random.normal
    mel, wide = r((1, smart_turn.N_FRAMES, smart_turn.N_MELS)), r((1, smart_turn.N_FRAMES, d))
    conv1, conv2 = r((d, 3, smart_turn.N_MELS)), r((d, 3, d))
    x, proj, fc1, fc2 = r((1, frames, d)), r((d, d)), r((d, 4 * d)), r((4 * d, d))
    q, weights = r((1, heads, frames, d // heads)), r((1, heads, frames, frames))
    operands = [mel, wide, conv1, conv2, x, proj, fc1, fc2, q, weights]
    mx.eval(operands)

    def run() -> None:
        out = [mx.conv1d(mel, conv1, padding=1), mx.conv1d(wide, conv2, stride=2, padding=1)]
        for _ in range(smart_turn.N_LAYERS):
            out += [x @ proj for _ in range(4)]  # q, k, v and output projections
            out += [q @ q.transpose(0, 1, 3, 2), weights @ q, (x @ fc1) @ fc2]
        mx.eval(out)

    return run


def main() -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = TurnEndModel(registry.prepare("smart-turn-v3.2", progress=False))
    source, _ = registry.resolve_source(registry.get_spec("smart-turn-v3.2").source)
    sessions = []
    for threads in (1, 2):  # 1: as pipecat runs it (cpu_count=1)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        sessions.append(ort.InferenceSession(str(smart_turn.find_onnx(source)), options))
    session, two_threads = sessions
    rng = np.random.default_rng(0)
    clips = [rng.normal(0, 0.1, 16000 * 3).astype(np.float32) for _ in range(8)]
    mels = np.stack([smart_turn.features(c).T for c in clips])  # (8, 80, 800)
    native = model.model.native

    def score(batch: list[np.ndarray], on_kernels: bool) -> Callable[[], object]:
        def run() -> object:
            model.model.native = on_kernels and native
            return model.complete_probability(batch)

        return run

    ports = {
        f"{prefix}ms_batch{len(batch)}": score(batch, prefix == "")
        for batch in (clips[:1], clips)
        for prefix in ("", "mlx_")
    }
    results = {
        "features_ms_per_clip": timed_ms(lambda: smart_turn.features(clips[0]), args.repeats),
        "native_kernels": native,
        **alternating_ms(ports, args.repeats),
        "mlx_float32_products_ms_batch1": timed_ms(float32_products(), args.repeats),
        "onnxruntime_ms_batch1": timed_ms(
            lambda: session.run(None, {"input_features": mels[:1]}), args.repeats
        ),
        "onnxruntime_ms_batch8": timed_ms(
            lambda: session.run(None, {"input_features": mels}), args.repeats
        ),
        "onnxruntime_2_threads_ms_batch1": timed_ms(
            lambda: two_threads.run(None, {"input_features": mels[:1]}), args.repeats
        ),
    }
    model.model.native = native
    print(json.dumps(results, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
