"""Cost per element of MLX's CPU elementwise ops that batched decode leans on, beside
numpy doing the same work in the same run.

At 8 streams every layer of a decode step takes `exp` over the attention scores (72
query rows x the context) and `sigmoid` over the SiLU input (8 x 1536); the default
shape is the scores at a 240-token context. `add` shows what an op costs when the
arithmetic is trivial. The `engine_` rows are the engine's llama model file's `exp` (a
`power` with base e), SiLU and softmax, which it uses instead of MLX's.

    python bench/elementwise.py [--rows 72] [--cols 241] [--rounds 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import engine

engine.setup()  # before anything imports mlx: the optimised BLAS

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine.models import llama  # noqa: E402


def median_us(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=72)
    parser.add_argument("--cols", type=int, default=241)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    x = mx.random.normal((args.rows, args.cols))
    mx.eval(x)
    xn = np.array(x)
    ops: dict[str, Callable[[], object]] = {
        "mlx_exp": lambda: mx.eval(mx.exp(x)),
        "mlx_sigmoid": lambda: mx.eval(mx.sigmoid(x)),
        "mlx_softmax": lambda: mx.eval(mx.softmax(x, axis=-1)),
        "mlx_add": lambda: mx.eval(x + 1),
        "mlx_silu": lambda: mx.eval(x * mx.sigmoid(x)),
        "engine_exp": lambda: mx.eval(llama.exp(x)),
        "engine_silu": lambda: mx.eval(llama.silu(x)),
        "engine_softmax": lambda: mx.eval(llama.softmax(x)),
        "numpy_exp": lambda: np.exp(xn),
    }
    n = args.rows * args.cols
    result: dict[str, float | int] = {"elements": n}
    for name, fn in ops.items():
        us = median_us(fn, args.rounds)
        result[f"{name}_us"] = round(us, 1)
        result[f"{name}_ns_per_element"] = round(us * 1000 / n, 2)
    result["mlx_exp_vs_numpy"] = round(result["mlx_exp_us"] / result["numpy_exp_us"], 1)
    result["engine_exp_vs_mlx"] = round(result["engine_exp_us"] / result["mlx_exp_us"], 2)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{n} float32 elements ({args.rows} x {args.cols}), CPU")
    for name in ops:
        us, per = result[f"{name}_us"], result[f"{name}_ns_per_element"]
        print(f"{name:14} {us:9.1f} us  {per:6.2f} ns/el")
    print(f"MLX exp / numpy exp: {result['mlx_exp_vs_numpy']}x")
    print(f"engine exp / MLX exp: {result['engine_exp_vs_mlx']}x")


if __name__ == "__main__":
    main()
