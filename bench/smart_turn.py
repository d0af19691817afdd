"""Smart Turn v3.2: milliseconds per turn-end score on MLX (this engine's port) and on
onnxruntime with pipecat's own ONNX file, in the same run, batch 1 and batch 8.

    .venv/bin/python bench/smart_turn.py [--repeats 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import engine.blas  # noqa: E402,F401  (before MLX: it picks the BLAS)
from engine import registry  # noqa: E402
from engine.models import smart_turn  # noqa: E402
from engine.turn_end import TurnEndModel  # noqa: E402


def timed_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return round(float(np.median(times)), 1)


def main() -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = TurnEndModel(registry.prepare("smart-turn-v3.2", progress=False))
    source, _ = registry.resolve_source(registry.get_spec("smart-turn-v3.2").source)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as pipecat runs it (cpu_count=1)
    session = ort.InferenceSession(str(smart_turn.find_onnx(source)), options)
    rng = np.random.default_rng(0)
    clips = [rng.normal(0, 0.1, 16000 * 3).astype(np.float32) for _ in range(8)]
    mels = np.stack([smart_turn.features(c).T for c in clips])  # (8, 80, 800)
    results = {
        "features_ms_per_clip": timed_ms(lambda: smart_turn.features(clips[0]), args.repeats),
        "mlx_ms_batch1": timed_ms(lambda: model.complete_probability(clips[:1]), args.repeats),
        "mlx_ms_batch8": timed_ms(lambda: model.complete_probability(clips), args.repeats),
        "onnxruntime_ms_batch1": timed_ms(
            lambda: session.run(None, {"input_features": mels[:1]}), args.repeats
        ),
        "onnxruntime_ms_batch8": timed_ms(
            lambda: session.run(None, {"input_features": mels}), args.repeats
        ),
    }
    print(json.dumps(results, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
