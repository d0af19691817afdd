"""Matmul speed of MLX's CPU backend with its bundled reference BLAS and with the BLAS
the engine loads (`engine.native.blas`), and the LM-head product of a decode step (1 or 8
576-wide rows times the LLM's 49152 x 576 embedding, 113 MB) through the kernels of
`engine.native.gemv_forward` and through the BLAS's plain sgemm, timed alternately.

Each measurement runs in a fresh child process, because the BLAS can only be chosen
before `mlx.core` is imported.

    python bench/blas.py [--size 2048] [--seconds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def measure(size: int, seconds: float) -> dict[str, Any]:
    """Run in the child: GFLOPS of a float32 `size`² matmul, repeated for `seconds`."""
    sys.path.insert(0, str(ROOT))
    from engine.native.blas import active_blas, ensure_fast_blas

    # Importing `engine` already did this; it must happen before mlx.core is imported.
    ensure_fast_blas()
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    a = mx.random.normal((size, size))
    b = mx.random.normal((size, size))
    mx.eval(a, b, a[:64, :64] @ b[:64, :64])  # warm up with a matmul too small to time
    runs, start = 0, time.perf_counter()
    while runs == 0 or time.perf_counter() - start < seconds:
        mx.eval(a @ b)
        runs += 1
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {
        "gflops": 2 * size**3 * runs / elapsed / 1e9,
        "blas": active_blas(),
        "runs": runs,
    }
    return result | rows_product_ms(1) | rows_product_ms(8)


def rows_product_ms(rows: int, rounds: int = 15) -> dict[str, float]:
    """Median ms of one (rows, 576) x (576, 49152) product, forwarded vs sgemm alternately."""
    from engine.native import gemv_forward

    if not gemv_forward.is_active():
        return {}
    import mlx.core as mx

    x, weight = mx.random.normal((rows, 576)), mx.random.normal((49152, 576))
    mx.eval(x, weight, x @ weight.T)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            gemv_forward.enable(on)
            start = time.perf_counter()
            mx.eval(x @ weight.T)
            times[on].append((time.perf_counter() - start) * 1000)
    gemv_forward.enable(True)
    return {
        f"rows{rows}_ms_forwarded": statistics.median(times[True]),
        f"rows{rows}_ms_sgemm": statistics.median(times[False]),
    }


def run_child(size: int, seconds: float, blas_env: str | None) -> dict[str, Any]:
    """The child's `measure` result, read back from its JSON."""
    env = dict(os.environ)
    env.pop("DUPLEX_GATEWAY_BLAS", None)
    if blas_env is not None:
        env["DUPLEX_GATEWAY_BLAS"] = blas_env
    cmd = [sys.executable, __file__, "--child", "--size", str(size), "--seconds", str(seconds)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.size, args.seconds)))
        return
    reference = run_child(args.size, args.seconds, "none")
    active = run_child(args.size, args.seconds, None)
    result = {
        "gflops_reference": round(reference["gflops"], 2),
        "gflops_active": round(active["gflops"], 2),
        "speedup": round(active["gflops"] / reference["gflops"], 1),
    }
    for rows in (1, 8):
        for route in ("forwarded", "sgemm"):
            key = f"rows{rows}_ms_{route}"
            if key in active:
                result[f"lm_head_{key}"] = round(active[key], 2)
    if args.json:
        print(json.dumps(result))
        return
    print(f"float32 matmul {args.size}x{args.size}, MLX CPU backend")
    print(f"{'BLAS':58} {'GFLOPS':>8}")
    print(f"{'reference (bundled with mlx)':58} {result['gflops_reference']:8.1f}")
    active_name = active["blas"] or "reference (no optimised BLAS found)"
    print(f"{active_name:58} {result['gflops_active']:8.1f}")
    print(f"speedup: {result['speedup']}x")
    for rows in (1, 8):
        if f"lm_head_rows{rows}_ms_forwarded" in result:
            print(
                f"{rows} x 576 . 576 x 49152: forwarded "
                f"{result[f'lm_head_rows{rows}_ms_forwarded']} ms, "
                f"sgemm {result[f'lm_head_rows{rows}_ms_sgemm']} ms"
            )


if __name__ == "__main__":
    main()
