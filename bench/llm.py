"""LLM speed: the embedded SmolLM2-135M-Instruct (or `--model`) through the project's LLM stage
(`engine.llm.stage.LlmStage` on the engine's llama model file), beside plain
`mlx_lm.stream_generate` on mlx-lm's own llama class, same converted directory, same
prompt, same run; plus cold (convert) and cached model start times.

    python bench/llm.py [--model NAME] [--precision auto] [--max-tokens 96] [--rounds 3]
                        [--shared-cache] [--json]

`--shared-cache` uses the model cache as it is (no cold conversion into a fresh one:
`load_s_cold` is then null), for models whose conversion takes minutes.

Prefill tok/s is prompt tokens over the time to the first token; decode tok/s is the
tokens after the first over the time they took. Each figure is the best of `--rounds`
runs, because other processes on a small machine only ever make a run slower.
Load times are `registry.prepare` + the stage's `from_path` (the engine's `load` and the
weights' compact twins) in this process (imports done); `process_start_s_cached` is a
whole fresh interpreter doing the same. `decode_tok_s_fp32_weights` is the same stage
with its compact twins left unread (`engine.native.gemv_forward`), alternating with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # before anything imports mlx: the optimised BLAS

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

from engine.llm.stage import LlmInput, LlmStage  # noqa: E402
from engine.native import gemv_forward  # noqa: E402
from engine.runtime.request import SamplingParams  # noqa: E402
from engine.weights import registry  # noqa: E402

MODEL = "smollm2-135m-instruct"
MESSAGES = [
    {
        "role": "user",
        "content": (
            "Here is some background. The Loire is the longest river in France. It rises "
            "in the Massif Central, flows north towards Orléans, then west through Tours "
            "and Nantes, and reaches the Atlantic at Saint-Nazaire. Its valley is known "
            "for its castles, vineyards and towns built of white tufa stone, and part of "
            "it is a World Heritage site. Now, please write a long, detailed travel guide "
            "for a week-long trip along the river, day by day, with places to visit."
        ),
    }
]


def timed_load(precision: str) -> tuple[float, Path, LlmStage]:
    start = time.perf_counter()
    path = registry.prepare(MODEL, precision=precision, progress=False)
    stage = LlmStage.from_path(path)
    return time.perf_counter() - start, path, stage


def process_start_s(precision: str) -> float:
    """A fresh interpreter: imports, cached `prepare` and the stage's load, all timed."""
    code = (
        "import time; t = time.perf_counter()\n"
        "import engine\n"
        "engine.setup()\n"
        "from engine import registry\n"
        "from engine.llm.stage import LlmStage\n"
        f"LlmStage.from_path(registry.prepare({MODEL!r}, precision={precision!r}))\n"
        "print(time.perf_counter() - t)\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    out.check_returncode()
    return float(out.stdout.strip().splitlines()[-1])


def run_stage(stage: LlmStage, max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    stage.add("bench", LlmInput(messages=MESSAGES, sampling_params=params))
    first = last = None
    out = None
    while stage.has_work():
        for item in stage.step():
            now = time.perf_counter()
            first = first or now
            last, out = now, item.payload
    assert out is not None and first is not None and last is not None
    n = out.completion_tokens
    return {
        "prompt_tokens": out.prompt_tokens,
        "tokens": n,
        "prefill_tok_s": out.prompt_tokens / (first - start),
        "decode_tok_s": (n - 1) / (last - first),
    }


def run_mlx_lm(model: Any, tokenizer: Any, max_tokens: int) -> dict[str, float]:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    last = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))[-1]
    return {
        "prompt_tokens": last.prompt_tokens,
        "tokens": last.generation_tokens,
        "prefill_tok_s": last.prompt_tps,
        "decode_tok_s": last.generation_tps,
    }


def best(runs: list[dict[str, float]], key: str) -> float:
    return max(r[key] for r in runs)


def measure(precision: str, max_tokens: int, rounds: int, shared: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="duplex-gateway-bench-") as cache:
        load_cold: float | None = None
        if not shared:
            os.environ[registry.CACHE_ENV] = cache
            load_cold, path, _ = timed_load(precision)
        load_cached, path, stage = timed_load(precision)
        start_cached = process_start_s(precision)
        plain_model = mlx_lm.load(str(path))[0]  # mlx-lm's own model class, same weights
        tokenizer = stage.tokenizer
        run_stage(stage, 8)  # warm-up: first calls compile and allocate
        run_mlx_lm(plain_model, tokenizer, 8)
        ours, fp32, plain = [], [], []
        twins = gemv_forward.live_twins() > 0
        for _ in range(rounds):
            ours.append(run_stage(stage, max_tokens))
            if twins:
                gemv_forward.use_twins(False)
                fp32.append(run_stage(stage, max_tokens))
                gemv_forward.use_twins(True)
            plain.append(run_mlx_lm(plain_model, tokenizer, max_tokens))
    decode = best(ours, "decode_tok_s")
    fp32_decode = best(fp32, "decode_tok_s") if fp32 else decode
    mlx_decode = best(plain, "decode_tok_s")
    return {
        "model": path.name,
        "blas": engine.native.blas.active_blas(),
        "device": str(mx.default_device()),
        "prompt_tokens": ours[0]["prompt_tokens"],
        "decode_tokens": ours[0]["tokens"],
        "prefill_tok_s": round(best(ours, "prefill_tok_s"), 1),
        "decode_tok_s": round(decode, 2),
        "mlx_lm_prefill_tok_s": round(best(plain, "prefill_tok_s"), 1),
        "mlx_lm_decode_tok_s": round(mlx_decode, 2),
        "decode_ratio": round(decode / mlx_decode, 3),
        "compact_twins": gemv_forward.live_twins(),
        "decode_tok_s_fp32_weights": round(fp32_decode, 2),
        "twin_speedup": round(decode / fp32_decode, 3),
        "load_s_cold": None if load_cold is None else round(load_cold, 2),
        "load_s_cached": round(load_cached, 3),
        "process_start_s_cached": round(start_cached, 2),
    }


def main() -> None:
    global MODEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="a registry LLM name")
    parser.add_argument("--precision", choices=registry.PRECISIONS, default="auto")
    parser.add_argument("--shared-cache", action="store_true", help="no cold conversion")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    MODEL = args.model
    result = measure(args.precision, args.max_tokens, args.rounds, args.shared_cache)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']} on {result['device']}, BLAS {result['blas']}")
    print(f"prompt {result['prompt_tokens']} tokens, up to {args.max_tokens} decoded, greedy")
    print(f"{'':24} {'prefill tok/s':>14} {'decode tok/s':>13}")
    print(f"{'engine LlmStage':24} {result['prefill_tok_s']:14.1f} {result['decode_tok_s']:13.2f}")
    print(
        f"{'mlx_lm.stream_generate':24} {result['mlx_lm_prefill_tok_s']:14.1f} "
        f"{result['mlx_lm_decode_tok_s']:13.2f}"
    )
    print(f"decode ratio (engine / mlx-lm): {result['decode_ratio']}")
    print(
        f"{result['compact_twins']} compact weight twins; without them "
        f"{result['decode_tok_s_fp32_weights']} tok/s (speedup {result['twin_speedup']})"
    )
    print(f"load: cold (convert) {result['load_s_cold']} s, cached {result['load_s_cached']} s")
    print(f"fresh process, cached model, imports included: {result['process_start_s_cached']} s")


if __name__ == "__main__":
    main()
