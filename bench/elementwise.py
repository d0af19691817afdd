"""Cost per element of MLX's CPU elementwise ops that batched decode leans on, beside
numpy doing the same work in the same run.

At 8 streams every layer of a decode step takes `exp` over the attention scores (72
query rows x the context) and `sigmoid` over the SiLU input (8 x 1536); the default
shape is the scores at a 240-token context. `add` shows what an op costs when the
arithmetic is trivial. The `engine_` rows are the engine's llama model file's `exp` (a
`power` with base e), SiLU and softmax, which it uses instead of MLX's.

The `fast_` rows are `engine.models.fast_ops` (polynomials in fused stages, which the
Whisper encoder and the voice use) beside MLX's own function, over a Whisper encoder
layer's MLP activations (`--act-rows` x `--act-cols`, 200 x 1536: a 4 s window).

    python bench/elementwise.py [--rows 72] [--cols 241] [--act-rows 200] [--act-cols 1536]
                                [--rounds 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import engine

engine.setup()  # before anything imports mlx: the optimised BLAS

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from engine.models import fast_ops, llama  # noqa: E402


def median_us(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _apply(fn: Callable[[mx.array], mx.array], x: mx.array) -> None:
    mx.eval(fn(x))


def activations(rows: int, cols: int, rounds: int) -> dict[str, float | int]:
    """`fast_ops` against MLX's own and numpy's `exp` over large activations: microseconds
    per call, and each fast function's time over MLX's."""
    a = mx.random.normal((rows, cols), key=mx.random.key(0)) * 3
    mx.eval(a)
    an = np.array(a)
    pairs: dict[str, tuple[Callable[[mx.array], mx.array], Callable[[mx.array], mx.array]]] = {
        "gelu": (nn.gelu, fast_ops.gelu),
        "tanh": (mx.tanh, fast_ops.tanh),
        "sigmoid": (mx.sigmoid, fast_ops.sigmoid),
        "softmax": (lambda x: mx.softmax(x, axis=-1), fast_ops.softmax),
    }
    result: dict[str, float | int] = {"act_elements": rows * cols}
    for name, (theirs, ours) in pairs.items():
        mlx_us = median_us(partial(_apply, theirs, a), rounds)
        fast_us = median_us(partial(_apply, ours, a), rounds)
        result[f"act_mlx_{name}_us"] = round(mlx_us, 1)
        result[f"act_fast_{name}_us"] = round(fast_us, 1)
        result[f"act_fast_{name}_vs_mlx"] = round(fast_us / mlx_us, 3)
    result["act_numpy_exp_us"] = round(median_us(lambda: np.exp(an), rounds), 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=72)
    parser.add_argument("--cols", type=int, default=241)
    parser.add_argument("--act-rows", type=int, default=200)
    parser.add_argument("--act-cols", type=int, default=1536)
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
    result.update(activations(args.act_rows, args.act_cols, args.rounds))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{n} float32 elements ({args.rows} x {args.cols}), CPU")
    for name in ops:
        us, per = result[f"{name}_us"], result[f"{name}_ns_per_element"]
        print(f"{name:14} {us:9.1f} us  {per:6.2f} ns/el")
    print(f"MLX exp / numpy exp: {result['mlx_exp_vs_numpy']}x")
    print(f"engine exp / MLX exp: {result['engine_exp_vs_mlx']}x")
    print(f"{args.act_rows} x {args.act_cols} activations: fast_ops / MLX's own")
    for key, value in result.items():
        if key.startswith("act_fast_") and key.endswith("_vs_mlx"):
            name = key.removeprefix("act_fast_").removesuffix("_vs_mlx")
            mlx_us, fast_us = result[f"act_mlx_{name}_us"], result[f"act_fast_{name}_us"]
            print(f"{name:14} {mlx_us:9.1f} us -> {fast_us:9.1f} us  ({value}x)")


if __name__ == "__main__":
    main()
