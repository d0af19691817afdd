"""The native decode step (`engine.native.llama_step`) against the llama model's own MLX
step: the same logits within float rounding, the same cache after it, each row's
result whatever the rows beside it, and MLX's step where the native one cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from engine.models import llama
from engine.native import build, gemv_forward, llama_step
from tests.test_gemv_forward import run_python
from tests.test_llm_stage import engine_model
from tests.test_llm_stage import tiny_model as mlx_lm_tiny_model

# Float rounding only: the norms' sums run in another order, expf stands for power(e, x).
TOLERANCE = 1e-4


def tiny_model(bias: bool = False, tied: bool = True) -> llama.Model:
    """The LLM stage tests' tiny random llama as the engine's class."""
    source = mlx_lm_tiny_model(attention_bias=bias, mlp_bias=bias, tie_word_embeddings=tied)
    return engine_model(source)


def prompts() -> list[list[int]]:
    return [[5, 9, 33, 7, 81, 2], [11, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]


def batch_of(model: llama.Model, rows: list[list[int]]) -> list[BatchKVCache]:
    """The KV of each row's prompt but its last token, merged into one batch (the rows
    left-padded to the longest), as the LLM stage joins its running batch."""
    caches = []
    for tokens in rows:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([tokens[:-1]]), cache=cache), [c.state for c in cache])
        caches.append(cache)
    return [BatchKVCache.merge(list(layer)) for layer in zip(*caches, strict=True)]


def mlx_logits(model: llama.Model, tokens: list[int], cache: list[BatchKVCache]) -> np.ndarray:
    return np.array(model(mx.array(tokens)[:, None], cache=cache)[:, -1, :])


def native(model: llama.Model) -> llama_step.LlamaStep:
    step = model.native_step()
    assert step is not None  # a C compiler and the forwarder are here
    return step


def state(cache: list[BatchKVCache]) -> list[np.ndarray]:
    return [np.array(a) for c in cache for a in c.keys_and_values()]


@pytest.mark.parametrize("bias, tied", [(False, True), (True, False)])
def test_steps_match_the_models_own_mlx_step(bias: bool, tied: bool) -> None:
    model = tiny_model(bias, tied)
    step = native(model)
    ours, theirs = batch_of(model, prompts()), batch_of(model, prompts())
    tokens = [p[-1] for p in prompts()]
    for _ in range(4):
        got = np.array(step.logits(tokens, ours))
        want = mlx_logits(model, tokens, theirs)
        assert np.abs(got - want).max() < TOLERANCE * np.abs(want).max()
        tokens = want.argmax(-1).tolist()
    for a, b in zip(state(ours), state(theirs), strict=True):
        assert a.shape == b.shape
        assert np.abs(a - b).max() < TOLERANCE * max(np.abs(b).max(), 1.0)
    assert [c.offset.tolist() for c in ours] == [c.offset.tolist() for c in theirs]


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it() -> None:
    model = tiny_model()
    step = native(model)
    rows = prompts()
    together = np.array(step.logits([p[-1] for p in rows], batch_of(model, rows)))
    for i, tokens in enumerate(rows):
        alone = np.array(step.logits([tokens[-1]], batch_of(model, [tokens])))
        assert np.array_equal(alone[0], together[i])


def test_mlx_steps_continue_a_cache_the_native_step_grew() -> None:
    # 254 positions: the merged cache fills, the native step grows it by a step of 256,
    # then MLX's step and the native one take turns over the grown arrays.
    model = tiny_model()
    step = native(model)
    long = [(7 * i) % 290 + 1 for i in range(255)]
    rows = [long, long[:40]]
    ours, theirs = batch_of(model, rows), batch_of(model, rows)
    tokens = [p[-1] for p in rows]
    for i in range(6):
        want = mlx_logits(model, tokens, theirs)
        got = np.array(step.logits(tokens, ours) if i % 2 == 0 else mlx_logits(model, tokens, ours))
        assert np.abs(got - want).max() < TOLERANCE * np.abs(want).max()
        tokens = want.argmax(-1).tolist()
    assert ours[0].keys.shape[2] == len(long) - 1 + BatchKVCache.step


def test_a_filtered_batch_is_read_again() -> None:
    model = tiny_model()
    step = native(model)
    ours, theirs = batch_of(model, prompts()), batch_of(model, prompts())
    tokens = [p[-1] for p in prompts()]
    step.logits(tokens, ours)
    mlx_logits(model, tokens, theirs)
    for cache in (ours, theirs):
        for layer in cache:
            layer.filter([0, 2])  # the shortest row goes: the padding shifts left
    got = np.array(step.logits([3, 4], ours))
    want = mlx_logits(model, [3, 4], theirs)
    assert np.abs(got - want).max() < TOLERANCE * np.abs(want).max()


def test_no_native_step_when_switched_off_or_the_forwarder_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model()
    monkeypatch.setenv(llama_step.ENV, "0")
    assert model.native_step() is None
    monkeypatch.delenv(llama_step.ENV)
    monkeypatch.setattr(gemv_forward, "is_active", lambda: False)
    assert model.native_step() is None


def test_no_native_step_without_a_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(llama_step, "_lib", None)
    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert build.library(llama_step.SOURCE, "llama_step", "fallback") is None
    assert tiny_model().native_step() is None


def test_weights_it_cannot_read_keep_mlxs_step() -> None:
    model = tiny_model()
    layer = model.layers[0].mlp.down_proj
    layer.weight = layer.weight.astype(mx.float16)
    assert model.native_step() is None


def test_without_an_optimised_blas_the_stage_decodes_with_mlx() -> None:
    # No BLAS to put the forwarder in front of: no native step, and the stage still runs.
    code = """
        import json
        import engine
        engine.setup()
        from tests.test_llama_step import tiny_model
        from engine.llm.stage import LlmInput, LlmStage
        from engine.runtime.request import SamplingParams
        from tests.test_llm_stage import ByteTokenizer, run
        stage = LlmStage(tiny_model(), ByteTokenizer())
        params = SamplingParams(temperature=0.0, max_tokens=5)
        stage.add("r", LlmInput(prompt_token_ids=[5, 6, 7], sampling_params=params))
        out = run(stage)["r"][-1]
        print(json.dumps([stage.use_native_step(True), len(out.output_token_ids)]))
    """
    assert run_python(code, DUPLEX_GATEWAY_BLAS="none") == [False, 5]


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from engine.llm.stage import LlmStage
    from engine.weights import registry

    return LlmStage.from_path(registry.prepare("smollm2-135m-instruct", progress=False))


@pytest.mark.models
@pytest.mark.parametrize("question", ["What is the capital of France?", "How do I boil an egg?"])
def test_smollm2_says_the_same_with_either_step(smollm2: Any, question: str) -> None:
    # Products over the twins rebuilt in floats: the two steps then differ by float
    # rounding only, and greedy decoding picks the same words.
    from engine.llm.stage import LlmInput
    from engine.runtime.request import SamplingParams

    def answer(native_step: bool) -> str:
        assert smollm2.use_native_step(native_step) == native_step
        params = SamplingParams(temperature=0.0, max_tokens=32)
        message = {"role": "user", "content": question}
        smollm2.add("q", LlmInput(messages=[message], sampling_params=params))
        last = None
        while smollm2.has_work():
            last = next((o.payload for o in smollm2.step()), last)
        return str(last.output_text)

    exact = gemv_forward.exact_twins(True)
    try:
        native, mlx = answer(True), answer(False)
    finally:
        gemv_forward.exact_twins(exact)
        smollm2.use_native_step(True)
    assert native == mlx
    assert len(native.split()) > 3
