"""The LLM stage on the real embedded SmolLM2-135M-Instruct, directly and via the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.llm.context import ContextLimitError, ContextLimits
from engine.llm.stage import LlmInput, LlmStage
from engine.models.llama import load
from engine.runtime import clients
from engine.runtime.core import AsyncEngine, EngineCore
from engine.runtime.request import SamplingParams
from engine.weights import registry

pytestmark = pytest.mark.models

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write one sentence about cats.",
    "How many legs does a spider have?",
    "What is two plus two?",
    "Give me a tip for sleeping well.",
    "Why is the sky blue?",
    "Say hello in Spanish.",
]


@pytest.fixture(scope="module")
def smollm() -> tuple[Any, Any]:
    return load(registry.prepare("smollm2-135m-instruct", progress=False))


def make_stage(smollm: tuple[Any, Any], **kw: Any) -> LlmStage:
    return LlmStage(*smollm, **kw)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def greedy(n: int = 24, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def run(stage: LlmStage) -> dict[str, Any]:
    last: dict[str, Any] = {}
    while stage.has_work():
        for o in stage.step():
            last[o.request_id] = o.payload
    return last


def test_greedy_alone_equals_batched_with_seven_others(smollm: tuple[Any, Any]) -> None:
    alone = make_stage(smollm)
    alone.add("q0", LlmInput(messages=chat(QUESTIONS[0]), sampling_params=greedy()))
    expected = run(alone)["q0"]
    batched = make_stage(smollm)
    for i, q in enumerate(QUESTIONS):
        batched.add(f"q{i}", LlmInput(messages=chat(q), sampling_params=greedy()))
    got = run(batched)
    assert got["q0"].output_token_ids == expected.output_token_ids
    assert "Paris" in got["q0"].output_text
    assert len(got) == 8 and all(o.finished for o in got.values())


def test_prompt_cache_second_turn_matches_cold_run(smollm: tuple[Any, Any]) -> None:
    stage = make_stage(smollm)
    history = chat("My name is Ada and I like gardening. Remember that.")
    stage.add("t1", LlmInput(messages=history, sampling_params=greedy(20), cache_key="s1"))
    reply = run(stage)["t1"].output_text
    history = history + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "What is my name?"},
    ]
    stage.add("t2", LlmInput(messages=history, sampling_params=greedy(20), cache_key="s1"))
    req = stage.request("t2")
    warm = run(stage)["t2"]
    assert req.cached_tokens > 40 and warm.cached_tokens == req.cached_tokens
    cold_stage = make_stage(smollm)
    cold_stage.add("t2", LlmInput(messages=history, sampling_params=greedy(20)))
    cold = run(cold_stage)["t2"]
    assert warm.output_token_ids == cold.output_token_ids
    assert cold.cached_tokens == 0


def test_new_session_prefills_only_after_the_shared_system_prompt(
    smollm: tuple[Any, Any],
) -> None:
    system = "You are a friendly voice assistant. Answer in one short sentence."
    stage = make_stage(smollm)
    shared = stage.cache_shared_prefix(system)
    for i, question in enumerate(QUESTIONS[:2]):
        history = [{"role": "system", "content": system}, *chat(question)]
        stage.add(
            f"new{i}", LlmInput(messages=history, sampling_params=greedy(16), cache_key=f"s{i}")
        )
        req = stage.request(f"new{i}")
        warm = run(stage)[f"new{i}"]
        assert req.cached_tokens == shared > 20 and req.cache_hit_type == "prefix"
        assert req.num_prompt_tokens - shared < 20  # only the user's message was prefilled
        cold_stage = make_stage(smollm)
        cold_stage.add("cold", LlmInput(messages=history, sampling_params=greedy(16)))
        cold = run(cold_stage)["cold"]
        assert cold.cached_tokens == 0
        assert warm.output_token_ids == cold.output_token_ids


def test_stop_string_on_real_text(smollm: tuple[Any, Any]) -> None:
    stage = make_stage(smollm)
    stage.add("free", LlmInput(messages=chat(QUESTIONS[2]), sampling_params=greedy(30)))
    text = run(stage)["free"].output_text
    word = text.split()[2]
    stage.add(
        "stopped", LlmInput(messages=chat(QUESTIONS[2]), sampling_params=greedy(30, stop=[word]))
    )
    out = run(stage)["stopped"]
    assert out.finish_reason == "stop"
    assert out.output_text == text[: text.index(word)]


async def test_engine_streams_without_blocking_the_loop(smollm: tuple[Any, Any]) -> None:
    core = EngineCore({"llm": make_stage(smollm)})
    core.start()
    engine_ = AsyncEngine(core)
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    async def consume(i: int) -> list[Any]:
        inputs = LlmInput(messages=chat(QUESTIONS[i]), sampling_params=greedy(16))
        return [o async for o in engine_.stream("llm", f"r{i}", inputs)]

    task = asyncio.create_task(ticker())
    try:
        results = await asyncio.gather(*(consume(i) for i in range(4)))
        stop.set()
        await task
        for outs in results:
            assert outs[-1].finished and outs[-1].payload.completion_tokens == len(outs)
            assert outs[-1].payload.finish_reason in ("stop", "length")
        assert ticks > 16  # the loop kept running while the engine thread decoded
        assert core.pending()["llm"] == 0
    finally:
        core.shutdown()


async def test_engine_abort_mid_stream_stops_output_and_frees(smollm: tuple[Any, Any]) -> None:
    stage = make_stage(smollm)
    core = EngineCore({"llm": stage})
    core.start()
    engine_ = AsyncEngine(core)
    try:
        inputs = LlmInput(messages=chat(QUESTIONS[6]), sampling_params=greedy(200))
        it = engine_.stream("llm", "long", inputs)
        seen = [await it.__anext__() for _ in range(3)]
        engine_.abort("llm", "long")
        assert [o async for o in it] == []
        assert all(not o.finished for o in seen)
        llm = clients.llm(engine_)
        await llm.run(lambda stage: stage.stats())  # runs after the abort on the engine thread
        assert core.pending()["llm"] == 0
        assert (await llm.run(lambda stage: stage.stats()))["running"] == 0
    finally:
        core.shutdown()


def test_context_limits_count_real_tokens(smollm: tuple[Any, Any]) -> None:
    limits = ContextLimits(max_user_message_tokens=64, max_context_tokens=160)
    stage = make_stage(smollm, context_limits=limits)
    long_message = "The quick brown fox jumps over the lazy dog. " * 8  # 81 tokens
    with pytest.raises(ContextLimitError, match="has 81 tokens") as err:
        stage.add("long", LlmInput(messages=chat(long_message), sampling_params=greedy()))
    assert err.value.code == "user_message_too_long"
    assert not stage.has_work()
    system = {"role": "system", "content": "Answer briefly."}
    history = [
        {"role": role, "content": f"Message number {i} of the history, kept or dropped."}
        for i, role in enumerate(["user", "assistant"] * 4)
    ]
    question = chat("What is the capital of France?")
    stage.add("fit", LlmInput(messages=[system, *history, *question], sampling_params=greedy()))
    prompt = stage.request("fit").prompt_token_ids
    assert prompt is not None and len(prompt) <= 160
    template = smollm[1].apply_chat_template
    kept = next(
        history[i:]
        for i in range(len(history) + 1)
        if template([system, *history[i:], *question], add_generation_prompt=True) == prompt
    )
    assert 0 < len(kept) < len(history)  # the oldest went, the newest stayed
    with pytest.raises(ContextLimitError, match="truncation is disabled"):
        stage.add(
            "strict",
            LlmInput(
                messages=[system, *history, *question], sampling_params=greedy(), truncate=False
            ),
        )
    run(stage)
