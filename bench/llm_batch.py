"""LLM stage throughput and latency beside plain mlx-lm, on the embedded SmolLM2.

Prints aggregate throughput of whole requests (prefill included) at 1/4/8/16 concurrent
streams, and of the decode alone at 1 and 8, `mlx_lm.batch_generate`
on the same model and prompts in the same run (1 and 8 streams and mlx-lm are measured
`--repeats` times in turn and each keeps its best round: on a shared machine the slower
rounds measure the neighbours' load rather than the code), time to first token for a
request that joins 8 decoding streams, cold versus cached second-turn TTFT of a
~500-token conversation, and event-loop lag while 8 streams decode through the engine
thread. The grammar mask's cost: aggregate tokens/s of 8 streams with 4 of them writing
a function call under the JSON-schema grammar (`engine.llm.grammar`) against 8 free streams,
alternated in the same run, best round of each.

    python bench/llm_batch.py [--json] [--max-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import engine

engine.setup()  # before anything imports mlx: the optimised BLAS

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm import batch_generate  # noqa: E402
from mlx_lm.generate import generation_stream  # noqa: E402

from engine.llm.stage import LlmInput, LlmStage  # noqa: E402
from engine.models.llama import load  # noqa: E402
from engine.native import gemv_forward  # noqa: E402
from engine.runtime.core import AsyncEngine, EngineCore, exit_process  # noqa: E402
from engine.runtime.request import SamplingParams  # noqa: E402
from engine.weights import registry  # noqa: E402

TOPICS = [
    "the ocean",
    "a lighthouse keeper",
    "mountains in winter",
    "a city at night",
    "an old library",
    "a robot learning to paint",
    "a desert caravan",
    "the first day of spring",
]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def story_prompt(i: int) -> list[dict[str, str]]:
    return chat(f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}.")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def generated(token_ids: list[int], eos: set[int]) -> int:
    # mlx-lm does not count the EOS token it stops on; count the same way here.
    return len(token_ids) - (1 if token_ids and token_ids[-1] in eos else 0)


def settle() -> None:
    """Wait for work an earlier run left in flight (ours on the default stream, mlx-lm's on
    its own), so that it is not timed as part of the next run."""
    mx.synchronize()
    mx.synchronize(generation_stream)


def stage_throughput(model: Any, tok: Any, n: int, max_tokens: int) -> tuple[float, float]:
    """Tokens per second of n whole requests (prefill included), and of their decode alone:
    the tokens after every stream has its first one, over the time after that."""
    stage = LlmStage(model, tok, max_running_sequences=max(n, 8))
    for i in range(n):
        stage.add(f"r{i}", LlmInput(messages=story_prompt(i), sampling_params=greedy(max_tokens)))
    settle()
    start = time.perf_counter()
    total, emitted, started = 0, 0, set()
    decode_start, emitted_before = start, 0
    while stage.has_work():
        for out in stage.step():
            emitted += 1
            if out.request_id not in started:
                started.add(out.request_id)
                if len(started) == n:
                    decode_start, emitted_before = time.perf_counter(), emitted
            if out.finished:
                total += generated(out.payload.output_token_ids, tok.eos_token_ids)
    end = time.perf_counter()
    decoded = total - emitted_before
    return total / (end - start), decoded / (end - decode_start)


# A call that cannot end within the run, so its rows stay under the grammar throughout.
LONG_CALL_TOOL = {
    "type": "function",
    "function": {
        "name": "take_notes",
        "description": "Write down notes about the story",
        "parameters": {
            "type": "object",
            "properties": {
                "notes": {"type": "array", "items": {"type": "string"}, "minItems": 500}
            },
            "required": ["notes"],
        },
    },
}


def mixed_throughput(model: Any, tok: Any, constrained: int, max_tokens: int) -> float:
    """Tokens per second of 8 whole requests, the first `constrained` forced to call."""
    stage = LlmStage(model, tok, max_running_sequences=8)
    for i in range(8):
        inputs = LlmInput(messages=story_prompt(i), sampling_params=greedy(max_tokens))
        if i < constrained:
            inputs.tools, inputs.tool_choice = [LONG_CALL_TOOL], "required"
        stage.add(f"r{i}", inputs)
    settle()
    start = time.perf_counter()
    total = 0
    while stage.has_work():
        for out in stage.step():
            assert out.error is None, out.error
            if out.finished:
                total += generated(out.payload.output_token_ids, tok.eos_token_ids)
    return total / (time.perf_counter() - start)


def mlx_lm_throughput(model: Any, tok: Any, n: int, max_tokens: int) -> float:
    prompts = [
        tok.apply_chat_template(story_prompt(i), add_generation_prompt=True) for i in range(n)
    ]
    settle()
    start = time.perf_counter()
    result = batch_generate(model, tok, prompts, max_tokens=max_tokens, return_token_ids=True)
    elapsed = time.perf_counter() - start
    assert result.token_ids is not None  # asked for with return_token_ids
    return sum(len(ids) for ids in result.token_ids) / elapsed


async def first_token_ms(engine_: AsyncEngine, rid: str, inputs: LlmInput) -> float:
    start = time.perf_counter()
    stream = engine_.stream("llm", rid, inputs)
    await stream.__anext__()
    elapsed = (time.perf_counter() - start) * 1000
    engine_.abort("llm", rid)
    return elapsed


async def drain(engine_: AsyncEngine, rid: str, inputs: LlmInput) -> int:
    """Consume a whole stream; returns how many outputs it carried."""
    return len([out async for out in engine_.stream("llm", rid, inputs)])


async def background(engine_: AsyncEngine, n: int, max_tokens: int) -> list[asyncio.Task]:
    def inputs(i: int) -> LlmInput:
        return LlmInput(messages=story_prompt(i), sampling_params=greedy(max_tokens))

    tasks = [asyncio.create_task(drain(engine_, f"bg{i}", inputs(i))) for i in range(n)]
    await asyncio.sleep(0)
    return tasks


async def loop_lag_ms(duration_s: float, interval_s: float = 0.005) -> list[float]:
    lags = []
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        start = time.perf_counter()
        await asyncio.sleep(interval_s)
        lags.append((time.perf_counter() - start - interval_s) * 1000)
    return lags


def conversation(target_tokens: int, tok: Any) -> list[dict[str, str]]:
    history: list[dict[str, str]] = []
    i = 0
    while (
        len(tok.apply_chat_template(history + chat("x"), add_generation_prompt=True))
        < target_tokens
    ):
        history += [
            {"role": "user", "content": f"Tell me something about {TOPICS[i % len(TOPICS)]}."},
            {
                "role": "assistant",
                "content": f"Here is a fact about {TOPICS[i % len(TOPICS)]}: it has inspired "
                "many stories, paintings and songs, and people keep returning to it.",
            },
        ]
        i += 1
    return history


async def engine_measurements(model: Any, tok: Any, max_tokens: int) -> dict[str, float]:
    core = EngineCore({"llm": LlmStage(model, tok, max_running_sequences=16)})
    core.start()
    engine_ = AsyncEngine(core)
    try:
        tasks = await background(engine_, 8, max_tokens * 4)
        await asyncio.sleep(1.0)  # let the 8 streams reach steady decode
        lags = await loop_lag_ms(3.0)
        ttfts = []
        for i in range(5):
            inputs = LlmInput(messages=chat(f"Say something about {TOPICS[i]}."))
            ttfts.append(await first_token_ms(engine_, f"new{i}", inputs))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

        history = conversation(500, tok)
        turn1 = history + chat("Summarise our conversation.")
        params = greedy(8)
        await drain(
            engine_, "t1", LlmInput(messages=turn1, sampling_params=params, cache_key="conv")
        )
        turn2 = turn1 + [
            {"role": "assistant", "content": "We talked about many things."},
            {"role": "user", "content": "Which topic was first?"},
        ]
        # No cache key: a key would borrow another session's shared prefix and not be cold.
        cold = await first_token_ms(engine_, "cold", LlmInput(messages=turn2, cache_key=None))
        cached = await first_token_ms(engine_, "warm", LlmInput(messages=turn2, cache_key="conv"))
    finally:
        core.shutdown()
    lags.sort()
    return {
        "ttft_ms_p50_under_load": statistics.median(ttfts),
        "ttft_ms_cold": cold,
        "ttft_ms_cached": cached,
        "event_loop_lag_ms_p99": lags[int(0.99 * (len(lags) - 1))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="rounds to keep the best of")
    args = parser.parse_args()

    path = registry.prepare("smollm2-135m-instruct")
    model, tok = load(path)  # the engine's model file, as the gateway runs it
    gemv_forward.compress(model)  # and its weights' compact twins (`LlmStage.from_path`)
    plain = mlx_lm.load(str(path))[0]  # mlx-lm's own, for its batch_generate
    stage_throughput(model, tok, 2, 4)  # warm up kernels and allocator
    once = {n: stage_throughput(model, tok, n, args.max_tokens) for n in (4, 16)}
    runs: dict[str, list[tuple[float, float]]] = {"1": [], "8": []}
    mlx_runs = []
    mixed_throughput(model, tok, 4, 4)  # builds the grammar's tokenizer once, untimed
    mixed: dict[int, list[float]] = {0: [], 4: []}
    for _ in range(max(1, args.repeats)):
        runs["1"].append(stage_throughput(model, tok, 1, args.max_tokens))
        runs["8"].append(stage_throughput(model, tok, 8, args.max_tokens))
        mlx_runs.append(mlx_lm_throughput(plain, tok, 8, args.max_tokens))
        for constrained in mixed:
            mixed[constrained].append(mixed_throughput(model, tok, constrained, args.max_tokens))
    best = {n: max(whole for whole, _ in r) for n, r in runs.items()}
    best_decode = {n: max(decode for _, decode in r) for n, r in runs.items()}
    aggregate = {"1": best["1"], "4": once[4][0], "8": best["8"], "16": once[16][0]}
    mlx8 = max(mlx_runs)
    result: dict[str, Any] = {
        "aggregate_tok_s": aggregate,
        "mlx_lm_batch_tok_s_8": mlx8,
        "batch8_vs_single": aggregate["8"] / aggregate["1"],
        "batch8_vs_mlx_lm": aggregate["8"] / mlx8,
        "decode_tok_s": best_decode,
        "decode8_vs_single": best_decode["8"] / best_decode["1"],
        "tok_s_8_streams_none_constrained": max(mixed[0]),
        "tok_s_8_streams_4_constrained": max(mixed[4]),
        "constrained_vs_none": max(mixed[4]) / max(mixed[0]),
    }
    result.update(asyncio.run(engine_measurements(model, tok, args.max_tokens)))
    result["cached_vs_cold_ttft"] = result["ttft_ms_cached"] / result["ttft_ms_cold"]
    result = {k: _round(v) for k, v in result.items()}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>26}: {value}")


def _round(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: round(x, 2) for k, x in v.items()}
    return round(v, 3)


if __name__ == "__main__":
    main()
    exit_process(0)
