"""Fair prefill: a short turn's time to first token while another session prefills a
long prompt, beside the same turn on an idle engine, on the embedded LLM stage as
configs/default.yaml builds it.

Each measurement goes through `EngineCore` and `AsyncEngine`, as the gateway's turns do.
The short turn starts once the long request has prefilled its first tokens (or more than
`--arrive-after` of them), so it arrives while that prefill is under way. Medians over
`--repeats` rounds.

    python bench/fairness.py [--json] [--repeats 5] [--long-tokens 2000] [--arrive-after 0]
                             [--slice-tokens N]  (default: the profile's)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import engine

engine.setup()  # before anything imports mlx: the optimised BLAS

from llm_batch import first_token_ms  # noqa: E402 - the same timing, one definition

from engine.build import prepare_model  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.llm.stage import LlmInput, LlmStage  # noqa: E402
from engine.runtime.core import AsyncEngine, EngineCore, exit_process  # noqa: E402
from engine.runtime.request import SamplingParams  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
FILLER = "The quick brown fox jumps over the lazy dog near the quiet river bank. "


def short_turn(i: int, system: str) -> LlmInput:
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Say hello number {i}."},
    ]
    return LlmInput(messages=messages, sampling_params=SamplingParams(temperature=0.0))


def long_turn(i: int, system: str, stage: LlmStage, target_tokens: int) -> LlmInput:
    """A user message of about `target_tokens` prompt tokens; `i` makes each one
    different, so no prompt cache can shorten it."""
    text = f"Request {i}. "
    while True:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": text + "Summarise this."},
        ]
        ids = stage.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if len(ids) >= target_tokens:
            return LlmInput(messages=messages, sampling_params=SamplingParams(temperature=0.0))
        text += FILLER


def build_stage(slice_tokens: int | None) -> tuple[LlmStage, str]:
    config = load_config(CONFIG)
    model = config.stages.llm.model
    assert model is not None  # the default profile runs the local backend
    limits = config.engine
    stage = LlmStage.from_path(
        prepare_model("llm", model, progress=False),
        max_running_sequences=limits.max_running_sequences,
        prefill_chunk_tokens=limits.prefill_chunk_tokens,
        prefill_slice_tokens=slice_tokens or limits.prefill_slice_tokens,
        prompt_cache_bytes=limits.prompt_cache_bytes,
    )
    return stage, config.system_prompt


async def prefilled(stage: LlmStage, rid: str, tokens: int) -> None:
    """Wait until request `rid` has prefilled more than `tokens` prompt tokens (read
    from the engine thread's state; a bench may poll it)."""
    while True:
        req = stage.request(rid)
        if req is not None and req.num_computed_tokens > tokens:
            return
        await asyncio.sleep(0.001)


async def measure(
    stage: LlmStage, system: str, repeats: int, long_tokens: int, arrive_after: int
) -> dict[str, Any]:
    core = EngineCore({"llm": stage})
    core.start()
    engine_ = AsyncEngine(core)
    try:
        await first_token_ms(engine_, "warm", short_turn(-1, system))
        await first_token_ms(engine_, "warm-long", long_turn(-1, system, stage, long_tokens))
        alone = [
            await first_token_ms(engine_, f"alone{i}", short_turn(i, system))
            for i in range(repeats)
        ]
        long_alone = [
            await first_token_ms(
                engine_, f"long-alone{i}", long_turn(i, system, stage, long_tokens)
            )
            for i in range(repeats)
        ]
        during, long_during = [], []
        for i in range(repeats):
            rid = f"long{i}"
            long_task = asyncio.create_task(
                first_token_ms(engine_, rid, long_turn(1000 + i, system, stage, long_tokens))
            )
            await prefilled(stage, rid, arrive_after)
            during.append(await first_token_ms(engine_, f"short{i}", short_turn(100 + i, system)))
            long_during.append(await long_task)
    finally:
        core.shutdown()
    alone_ms = statistics.median(alone)
    during_ms = statistics.median(during)
    return {
        "short_ttft_ms_alone": alone_ms,
        "short_ttft_ms_during_long_prefill": during_ms,
        "ratio": during_ms / alone_ms,
        "long_ttft_ms_alone": statistics.median(long_alone),
        "long_ttft_ms_with_short": statistics.median(long_during),
        "long_prompt_tokens": len(
            stage.tokenizer.apply_chat_template(
                long_turn(0, system, stage, long_tokens).messages, add_generation_prompt=True
            )
        ),
        "short_arrives_after_tokens": arrive_after,
        "prefill_chunk_tokens": stage.prefill_chunk_tokens,
        "prefill_slice_tokens": stage.prefill_slice_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5, help="rounds to take the median of")
    parser.add_argument("--long-tokens", type=int, default=2000, help="the long prompt's size")
    parser.add_argument(
        "--arrive-after",
        type=int,
        default=0,
        help="start the short turn once the long one has prefilled more tokens than this",
    )
    parser.add_argument(
        "--slice-tokens", type=int, default=None, help="the most of one prompt a step prefills"
    )
    args = parser.parse_args()

    stage, system = build_stage(args.slice_tokens)
    repeats = max(1, args.repeats)
    result = asyncio.run(measure(stage, system, repeats, args.long_tokens, args.arrive_after))
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>34}: {value}")


if __name__ == "__main__":
    main()
    exit_process(0)
