"""The LLM stage's scheduler and batch, on a tiny random llama and a byte tokenizer: as
mlx-lm's class, and as the engine's own, whose decode steps run natively."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from engine.llm.stage import LlmInput, LlmStage
from engine.models import llama as engine_llama
from engine.runtime.request import RequestOutput, RequestStatus, SamplingParams

EOS = 256


class ByteTokenizer:
    """Tokens are UTF-8 bytes, so multi-byte characters span tokens; 256 is EOS."""

    eos_token_ids = {EOS}

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return list(text.encode())


def tiny_model(**overrides: Any) -> llama.Model:
    mx.random.seed(0)
    shape: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 300,
        "tie_word_embeddings": True,
    }
    args = llama.ModelArgs(**{**shape, **overrides})
    model = llama.Model(args)
    # Larger weights give peaked, tie-free logits so greedy runs are stable.
    model.update({"model": {"embed_tokens": {"weight": model.model.embed_tokens.weight * 20}}})
    mx.eval(model.parameters())
    return model


def engine_model(source: llama.Model) -> engine_llama.Model:
    """`source` as the engine's llama class: the same weights, projections joined."""
    model = engine_llama.Model(source.args)
    weights = dict(tree_flatten(source.parameters()))
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=["mlx-lm", "native-step"])
def model(request: pytest.FixtureRequest) -> llama.Model:
    if request.param == "mlx-lm":
        return tiny_model()
    model = engine_model(tiny_model())
    assert model.native_step() is not None  # a C compiler and the forwarder are here
    return model


def make_stage(model: llama.Model, **kw: Any) -> LlmStage:
    return LlmStage(model, ByteTokenizer(), **kw)


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 250 + 1 for i in range(n)]


def script(text: bytes | list[int]) -> Any:
    """A logits processor that forces the model to emit `text`, then EOS."""
    forced = list(text) + [EOS]

    def force(tokens: mx.array, logits: mx.array) -> mx.array:
        produced = force.calls
        force.calls += 1
        out = mx.full(logits.shape, -1e9)
        out[:, forced[min(produced, len(forced) - 1)]] = 0.0
        return out

    force.calls = 0
    return force


def run(stage: LlmStage, steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(steps):
        if not stage.has_work():
            break
        for o in stage.step():
            outs.setdefault(o.request_id, []).append(o.payload)
    return outs


def generate(stage: LlmStage, ids: list[int], params: SamplingParams, **kw: Any) -> list[int]:
    stage.add("solo", LlmInput(prompt_token_ids=ids, sampling_params=params, **kw))
    return run(stage)["solo"][-1].output_token_ids


def test_greedy_alone_equals_batched(model: llama.Model) -> None:
    alone = generate(make_stage(model), prompt(9), greedy(16))
    stage = make_stage(model)
    for i in range(8):
        stage.add(
            f"r{i}", LlmInput(prompt_token_ids=prompt(5 + 3 * i, i), sampling_params=greedy(16))
        )
    stage.add("target", LlmInput(prompt_token_ids=prompt(9), sampling_params=greedy(16)))
    outs = run(stage)
    assert outs["target"][-1].output_token_ids == alone


def test_outputs_stream_deltas_and_usage(model: llama.Model) -> None:
    stage = make_stage(model)
    stage.add("r", LlmInput(prompt_token_ids=prompt(6), sampling_params=greedy(5)))
    outs = run(stage)["r"]
    assert [len(o.new_token_ids) for o in outs] == [1] * 5
    last = outs[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.output_token_ids == [t for o in outs for t in o.new_token_ids]
    assert last.output_text == "".join(o.new_text for o in outs)
    assert last.usage() == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    assert not any(o.finished for o in outs[:-1])


def test_first_token_comes_from_the_prefill_forward(model: llama.Model) -> None:
    stage = make_stage(model)
    stage.add("r", LlmInput(prompt_token_ids=prompt(6), sampling_params=greedy(5)))
    first = stage.step()
    # The prefill's last position gives the first token within the prefill's own step.
    assert [(o.request_id, len(o.payload.new_token_ids)) for o in first] == [("r", 1)]
    one = LlmInput(prompt_token_ids=prompt(7, 1), sampling_params=greedy(1), cache_key="s")
    stage.add("one", one)
    outs = [o for o in stage.step() if o.request_id == "one"]
    assert len(outs) == 1 and outs[0].finished and outs[0].payload.completion_tokens == 1
    assert stage.stats()["running"] == 1  # "one" finished without joining the batch
    hit = stage.prompt_cache.take("s", prompt(7, 1) + [0])
    assert hit is not None and hit.num_tokens == 7  # its whole prompt's KV was kept
    # From then on every step hands out exactly one token: no step waits on the pipeline.
    per_step = []
    while stage.has_work():
        per_step.append([len(o.payload.new_token_ids) for o in stage.step()])
    assert per_step == [[1]] * 3


def test_max_tokens_caps_length(model: llama.Model) -> None:
    assert len(generate(make_stage(model), prompt(4), greedy(3))) == 3


def test_stop_token_ids_end_with_stop(model: llama.Model) -> None:
    forced = script(b"abcdef")
    stage = make_stage(model)
    params = greedy(50, stop_token_ids=[ord("d")], logits_processors=[forced])
    stage.add("r", LlmInput(prompt_token_ids=prompt(4), sampling_params=params))
    last = run(stage)["r"][-1]
    assert last.finish_reason == "stop" and last.output_token_ids == list(b"abcd")
    assert last.output_text == "abc"


def test_eos_ends_with_stop(model: llama.Model) -> None:
    stage = make_stage(model)
    params = greedy(50, logits_processors=[script(b"hi")])
    stage.add("r", LlmInput(prompt_token_ids=prompt(4), sampling_params=params))
    last = run(stage)["r"][-1]
    assert last.finish_reason == "stop" and last.output_text == "hi"


def test_stop_string_spanning_tokens(model: llama.Model) -> None:
    stage = make_stage(model)
    params = greedy(50, stop=["STOP"], logits_processors=[script(b"one two STOP three")])
    stage.add("r", LlmInput(prompt_token_ids=prompt(4), sampling_params=params))
    outs = run(stage)["r"]
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].output_text == "one two " == "".join(o.new_text for o in outs)
    assert all("S" not in o.new_text for o in outs)


def test_multibyte_utf8_at_delta_boundaries(model: llama.Model) -> None:
    text = "añb€c🎉"
    stage = make_stage(model)
    params = greedy(50, logits_processors=[script(text.encode())])
    stage.add("r", LlmInput(prompt_token_ids=prompt(4), sampling_params=params))
    outs = run(stage)["r"]
    deltas = [o.new_text for o in outs]
    assert "".join(deltas) == text == outs[-1].output_text
    assert all("\ufffd" not in d for d in deltas)
    assert "🎉" in deltas  # four tokens, one delta
    assert deltas.count("") >= 3 + 2 + 1  # bytes held back while a char was incomplete


def test_per_request_sampling_in_one_batch(model: llama.Model) -> None:
    stage = make_stage(model)
    stage.add(
        "forced",
        LlmInput(
            prompt_token_ids=prompt(4),
            sampling_params=greedy(50, logits_processors=[script(b"xyz")]),
        ),
    )
    stage.add("greedy", LlmInput(prompt_token_ids=prompt(9), sampling_params=greedy(6)))
    stage.add(
        "hot",
        LlmInput(
            prompt_token_ids=prompt(9),
            sampling_params=SamplingParams(temperature=2.0, top_p=1.0, max_tokens=6, seed=3),
        ),
    )
    outs = run(stage)
    assert outs["forced"][-1].output_text == "xyz"
    assert outs["greedy"][-1].output_token_ids == generate(make_stage(model), prompt(9), greedy(6))
    hot = SamplingParams(temperature=2.0, top_p=1.0, max_tokens=6, seed=3)
    assert outs["hot"][-1].output_token_ids == generate(make_stage(model), prompt(9), hot)


def flat(tokens: mx.array, logits: mx.array) -> mx.array:
    return mx.zeros_like(logits)  # uniform: every draw depends on the random key only


def test_seeded_sampling_reproducible_and_batch_independent(model: llama.Model) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0, top_p=1.0, max_tokens=10, seed=seed, logits_processors=[flat]
        )

    a = generate(make_stage(model), prompt(5), params(42))
    c = generate(make_stage(model), prompt(5), params(7))
    stage = make_stage(model)
    for i in range(3):
        stage.add(f"other{i}", LlmInput(prompt_token_ids=prompt(6, i), sampling_params=params(i)))
    stage.add("again", LlmInput(prompt_token_ids=prompt(5), sampling_params=params(42)))
    b = run(stage)["again"][-1].output_token_ids
    assert a == b and a != c


def test_priority_admission_order(model: llama.Model) -> None:
    stage = make_stage(model, max_running_sequences=1)
    stage.add(
        "late-low", LlmInput(prompt_token_ids=prompt(4), sampling_params=greedy(2), priority=5)
    )
    stage.add("urgent", LlmInput(prompt_token_ids=prompt(4), sampling_params=greedy(2), priority=0))
    first = []
    while stage.has_work():
        first.extend(o.request_id for o in stage.step())
    assert first[0] == "urgent" and first[-1] == "late-low"


def test_chunked_prefill_never_stalls_decodes(model: llama.Model) -> None:
    stage = make_stage(model, prefill_chunk_tokens=16, max_tokens_per_step=64)
    stage.add("decoding", LlmInput(prompt_token_ids=prompt(4), sampling_params=greedy(40)))
    stage.step()
    stage.add("long", LlmInput(prompt_token_ids=prompt(200), sampling_params=greedy(2)))
    steps_with_token = 0
    while stage.request("long") is not None and stage.request("long").num_computed_tokens < 199:
        outs = stage.step()
        assert any(o.request_id == "decoding" for o in outs)
        steps_with_token += 1
        assert stage.stats()["prefilling"] <= 1
    assert steps_with_token >= 199 // 16


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_abort_in_each_state_frees_the_slot(model: llama.Model, state: str) -> None:
    stage = make_stage(
        model, max_running_sequences=1, prefill_chunk_tokens=16, max_tokens_per_step=32
    )
    stage.add("blocker", LlmInput(prompt_token_ids=prompt(4), sampling_params=greedy(30)))
    if state == "waiting":
        stage.step()
        stage.add("victim", LlmInput(prompt_token_ids=prompt(4), sampling_params=greedy(30)))
        stage.step()
        assert stage.stats()["waiting"] == 1
    else:
        stage.abort("blocker")
        length = 100 if state == "prefilling" else 4
        stage.add("victim", LlmInput(prompt_token_ids=prompt(length), sampling_params=greedy(30)))
        stage.step()
        key = "prefilling" if state == "prefilling" else "running"
        assert stage.stats()[key] == 1
    victim = stage.request("victim")
    stage.abort("victim")
    assert victim.status == RequestStatus.FINISHED_ABORTED
    assert victim.get_finish_reason() == "abort"
    assert stage.request("victim") is None
    outs = run(stage)
    assert "victim" not in outs
    stats = stage.stats()
    assert stats["waiting"] == stats["prefilling"] == stats["running"] == stats["kv_tokens"] == 0
    assert not stage.has_work()


def test_abort_mid_batch_keeps_other_rows_exact(model: llama.Model) -> None:
    alone = generate(make_stage(model), prompt(7, 3), greedy(12))
    stage = make_stage(model)
    stage.add("keep", LlmInput(prompt_token_ids=prompt(7, 3), sampling_params=greedy(12)))
    stage.add("drop", LlmInput(prompt_token_ids=prompt(30), sampling_params=greedy(12)))
    got = []
    for i in range(30):
        if not stage.has_work():
            break
        if i == 4:
            stage.abort("drop")
        got += [o.payload for o in stage.step() if o.request_id == "keep"]
    assert got[-1].output_token_ids == alone


def test_preemption_and_resume_give_uninterrupted_output(model: llama.Model) -> None:
    reference = {}
    for name, off in [("a", 0), ("b", 5)]:
        reference[name] = generate(make_stage(model), prompt(20, off), greedy(30))
    # Budget for both prompts but not both completions: the later one is preempted.
    stage = make_stage(model, max_kv_tokens=80)
    stage.add("a", LlmInput(prompt_token_ids=prompt(20, 0), sampling_params=greedy(30)))
    stage.add("b", LlmInput(prompt_token_ids=prompt(20, 5), sampling_params=greedy(30)))
    statuses = set()
    outs: dict[str, list[RequestOutput]] = {}
    while stage.has_work():
        for o in stage.step():
            outs.setdefault(o.request_id, []).append(o.payload)
        req = stage.request("b")
        if req is not None:
            statuses.add(req.status)
        assert stage.stats()["kv_tokens"] <= 80
    assert RequestStatus.PREEMPTED in statuses and stage.num_preemptions >= 1
    for name in ("a", "b"):
        assert outs[name][-1].output_token_ids == reference[name]
        assert "".join(o.new_text for o in outs[name]) == outs[name][-1].output_text


def test_prompt_cache_hit_gives_cold_tokens(model: llama.Model) -> None:
    turn1 = prompt(40)
    stage = make_stage(model)
    first = generate(stage, turn1, greedy(10), cache_key="conv")
    turn2 = turn1 + first + prompt(15, 11)
    stage.add("t2", LlmInput(prompt_token_ids=turn2, sampling_params=greedy(10), cache_key="conv"))
    req = stage.request("t2")
    warm = run(stage)["t2"]
    # The whole first turn: the step in flight at its finish wrote its last token's KV.
    assert req.cache_hit_type == "prefix" and req.cached_tokens == 40 + 10
    assert warm[-1].cached_tokens == req.cached_tokens
    cold = generate(make_stage(model), turn2, greedy(10))
    assert warm[-1].output_token_ids == cold


def test_prompt_cache_after_truncated_history(model: llama.Model) -> None:
    # Barge-in: the assistant's reply is cut in history; reuse shrinks to the common part.
    turn1 = prompt(30)
    stage = make_stage(model)
    reply = generate(stage, turn1, greedy(12), cache_key="conv")
    turn2 = turn1 + reply[:3] + prompt(8, 2)
    stage.add("t2", LlmInput(prompt_token_ids=turn2, sampling_params=greedy(8), cache_key="conv"))
    req = stage.request("t2")
    got = run(stage)["t2"][-1].output_token_ids
    assert req.cache_hit_type == "lcp" and req.cached_tokens == 33
    assert got == generate(make_stage(model), turn2, greedy(8))


def test_aborted_session_request_keeps_its_prefix_for_next_turn(model: llama.Model) -> None:
    stage = make_stage(model)
    turn1 = prompt(30)
    stage.add("t1", LlmInput(prompt_token_ids=turn1, sampling_params=greedy(50), cache_key="conv"))
    for _ in range(4):
        stage.step()
    stage.abort("t1")
    assert stage.stats()["prompt_cache_entries"] == 1
    stage.add(
        "t2",
        LlmInput(
            prompt_token_ids=turn1 + prompt(5, 1), sampling_params=greedy(4), cache_key="conv"
        ),
    )
    assert stage.request("t2") is not None
    run(stage)
    assert stage.prompt_cache.nbytes > 0


def test_messages_use_the_chat_template(model: llama.Model) -> None:
    stage = make_stage(model)
    msgs = [{"role": "user", "content": "hi"}]
    stage.add("m", LlmInput(messages=msgs, sampling_params=greedy(2)))
    last = run(stage)["m"][-1]
    assert last.prompt_tokens == len(ByteTokenizer().apply_chat_template(msgs))


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        (LlmInput(), "exactly one"),
        (
            LlmInput(prompt_token_ids=[1], messages=[{"role": "user", "content": "x"}]),
            "exactly one",
        ),
        (LlmInput(prompt_token_ids=[]), "empty"),
        (LlmInput(prompt_token_ids=[1, 999]), "token ids"),
        ({"prompt_token_ids": [1]}, "LlmInput"),
        (LlmInput(prompt_token_ids=[1] * 60, sampling_params=greedy(50)), "KV budget"),
    ],
)
def test_invalid_inputs_are_rejected(model: llama.Model, inputs: Any, match: str) -> None:
    stage = make_stage(model, max_kv_tokens=100)
    with pytest.raises(ValueError, match=match):
        stage.add("bad", inputs)
    assert not stage.has_work()


def test_duplicate_request_id_is_rejected(model: llama.Model) -> None:
    stage = make_stage(model)
    stage.add("r", LlmInput(prompt_token_ids=[1, 2]))
    with pytest.raises(ValueError, match="already live"):
        stage.add("r", LlmInput(prompt_token_ids=[1, 2]))


def test_failing_logits_processor_fails_only_its_request(model: llama.Model) -> None:
    def broken(tokens: mx.array, logits: mx.array) -> mx.array:
        raise RuntimeError("bad processor")

    alone = generate(make_stage(model), prompt(6), greedy(6))
    stage = make_stage(model)
    stage.add(
        "bad",
        LlmInput(prompt_token_ids=prompt(5), sampling_params=greedy(6, logits_processors=[broken])),
    )
    stage.add("good", LlmInput(prompt_token_ids=prompt(6), sampling_params=greedy(6)))
    errors: dict[str, str | None] = {}
    good: list[RequestOutput] = []
    while stage.has_work():
        for o in stage.step():
            if o.finished:
                errors[o.request_id] = o.error
            if o.request_id == "good":
                good.append(o.payload)
    assert "bad processor" in errors["bad"] and errors["good"] is None
    assert good[-1].output_token_ids == alone


def test_a_step_that_fails_as_first_tokens_go_out_leaves_nothing_live(
    model: llama.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine fails every live request of a stage whose step raised by aborting each
    # one: a request between its prefill and the batch must go too.
    stage = make_stage(model)
    stage.add("a", LlmInput(prompt_token_ids=prompt(4), sampling_params=greedy(6)))
    stage.add("b", LlmInput(prompt_token_ids=prompt(5), sampling_params=greedy(6)))

    def broken(*args: Any) -> None:
        raise RuntimeError("output failed")

    monkeypatch.setattr(stage._outputs, "output", broken)
    with pytest.raises(RuntimeError, match="output failed"):
        stage.step()
    monkeypatch.undo()
    stage.abort("a")
    stage.abort("b")
    assert stage.request("a") is None and stage.request("b") is None
    stats = stage.stats()
    assert stats["waiting"] == stats["prefilling"] == stats["running"] == 0
    assert not stage.has_work()


def test_preemption_also_reclaims_a_prefilling_request(model: llama.Model) -> None:
    stage = make_stage(model, max_kv_tokens=120, prefill_chunk_tokens=8, max_tokens_per_step=32)
    stage.add("a", LlmInput(prompt_token_ids=prompt(10), sampling_params=greedy(100)))
    while stage.stats()["kv_tokens"] < 20:
        stage.step()
    # Admitted exactly at the budget; "a" keeps growing while "b" prefills slowly.
    stage.add("b", LlmInput(prompt_token_ids=prompt(100, 1), sampling_params=greedy(8), priority=1))
    reference = generate(make_stage(model), prompt(100, 1), greedy(8))
    preempted_while_prefilling = False
    outs: dict[str, list[RequestOutput]] = {}
    while stage.has_work():
        was_prefilling = stage.stats()["prefilling"] == 1
        for o in stage.step():
            outs.setdefault(o.request_id, []).append(o.payload)
        b = stage.request("b")
        if b is not None and b.status == RequestStatus.PREEMPTED and was_prefilling:
            preempted_while_prefilling = True
        assert stage.stats()["kv_tokens"] <= 120
    assert preempted_while_prefilling
    assert outs["b"][-1].output_token_ids == reference
    assert len(outs["a"][-1].output_token_ids) == 100


def test_finished_output_carries_latency_metrics(model: llama.Model) -> None:
    stage = make_stage(model)
    stage.add("r", LlmInput(prompt_token_ids=prompt(4), sampling_params=greedy(3)))
    finished: list[Any] = []
    while stage.has_work():
        finished += [o for o in stage.step() if o.finished]
    assert set(finished[0].metrics) == {"ttft_s", "e2e_s", "decode_tok_s"}
    assert 0 <= finished[0].metrics["ttft_s"] <= finished[0].metrics["e2e_s"]


# --- the pipelined decode: a step is in flight whenever the batch changes ---------------


def solo(model: llama.Model, ids: list[int], params: SamplingParams) -> list[int]:
    return generate(make_stage(model), ids, params)


def test_finishes_in_a_batch_never_leak_the_step_in_flight(model: llama.Model) -> None:
    cases = {
        "len3": (prompt(5), greedy(3)),
        "len1": (prompt(8, 2), greedy(1)),
        "stop-id": (prompt(4), greedy(50, stop_token_ids=[ord("c")], logits_processors=[])),
        "eos": (prompt(6, 1), greedy(50)),
        "long": (prompt(9, 4), greedy(20)),
    }
    forced = {"stop-id": script(b"abcdef"), "eos": script(b"xy")}
    stage = make_stage(model)
    for name, (ids, params) in cases.items():
        if name in forced:
            params = greedy(
                params.max_tokens,
                stop_token_ids=params.stop_token_ids,
                logits_processors=[forced[name]],
            )
        key = name if name.startswith("len") else None
        stage.add(name, LlmInput(prompt_token_ids=ids, sampling_params=params, cache_key=key))
    outs = run(stage)
    for stream in outs.values():
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        assert len(stream) == stream[-1].completion_tokens  # one token per output
    assert len(outs["len3"][-1].output_token_ids) == 3
    assert len(outs["len1"][-1].output_token_ids) == 1
    assert outs["stop-id"][-1].output_token_ids == list(b"abc")
    assert outs["eos"][-1].output_token_ids == list(b"xy") + [EOS]
    assert outs["long"][-1].output_token_ids == solo(model, prompt(9, 4), greedy(20))
    # The KV each kept matches its recorded tokens: "len1" finished within the padded
    # prefill (its one output has no KV yet), "len3" has all three outputs' KV.
    for name, ids, kv in (("len1", prompt(8, 2), 8), ("len3", prompt(5), 5 + 3)):
        recorded = ids + outs[name][-1].output_token_ids
        hit = stage.prompt_cache.take(name, recorded + [0])
        assert hit is not None and hit.num_tokens == kv


def test_sequences_joining_a_decoding_batch_match_solo_runs(model: llama.Model) -> None:
    stage = make_stage(model)
    stage.add("a", LlmInput(prompt_token_ids=prompt(7), sampling_params=greedy(20)))
    outs: dict[str, list[RequestOutput]] = {}
    for i in range(60):
        if i in (2, 5):
            name = f"join{i}"
            stage.add(name, LlmInput(prompt_token_ids=prompt(4 + i, i), sampling_params=greedy(9)))
        if not stage.has_work():
            break
        for o in stage.step():
            outs.setdefault(o.request_id, []).append(o.payload)
    assert outs["a"][-1].output_token_ids == solo(model, prompt(7), greedy(20))
    for i in (2, 5):
        assert outs[f"join{i}"][-1].output_token_ids == solo(model, prompt(4 + i, i), greedy(9))


def test_abort_emits_nothing_drawn_and_keeps_kv_exactly_for_emitted_tokens(
    model: llama.Model,
) -> None:
    turn1 = prompt(20)
    stage = make_stage(model)
    stage.add("t1", LlmInput(prompt_token_ids=turn1, sampling_params=greedy(40), cache_key="c"))
    stage.add("mate", LlmInput(prompt_token_ids=prompt(9, 3), sampling_params=greedy(40)))
    emitted: list[int] = []
    for _ in range(5):
        emitted += [
            t for o in stage.step() if o.request_id == "t1" for t in o.payload.new_token_ids
        ]
    stage.abort("t1")
    assert all(o.request_id != "t1" for o in stage.step())
    turn2 = turn1 + emitted + prompt(6, 9)
    stage.add("t2", LlmInput(prompt_token_ids=turn2, sampling_params=greedy(8), cache_key="c"))
    req = stage.request("t2")
    warm = run(stage)["t2"][-1].output_token_ids
    # The KV handed over covers the prompt and every emitted token, and nothing else.
    assert req.cached_tokens == len(turn1) + len(emitted)
    assert warm == solo(model, turn2, greedy(8))


def seeded(seed: int, n: int) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=n, seed=seed, logits_processors=[flat]
    )


def test_preempted_seeded_request_resumes_with_the_same_draws(model: llama.Model) -> None:
    reference = solo(model, prompt(20, 5), seeded(11, 30))
    stage = make_stage(model, max_kv_tokens=80)
    stage.add("a", LlmInput(prompt_token_ids=prompt(20), sampling_params=greedy(30)))
    stage.add("b", LlmInput(prompt_token_ids=prompt(20, 5), sampling_params=seeded(11, 30)))
    outs = run(stage)
    assert stage.num_preemptions >= 1
    assert outs["b"][-1].output_token_ids == reference
    assert [t for o in outs["b"] for t in o.new_token_ids] == reference


def test_processors_see_the_token_still_being_read(model: llama.Model) -> None:
    seen: list[mx.array] = []

    def record(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(tokens)
        return logits

    stage = make_stage(model)
    ids = prompt(6)
    params = greedy(8, logits_processors=[record], repetition_penalty=1.3, presence_penalty=0.5)
    stage.add("r", LlmInput(prompt_token_ids=ids, sampling_params=params))
    stage.add("mate", LlmInput(prompt_token_ids=prompt(5, 2), sampling_params=greedy(12)))
    out = run(stage)["r"][-1].output_token_ids
    full = ids + out
    # Call k (0-based) draws output token k, so it must see the prompt and k outputs.
    assert [s.tolist() for s in seen[: len(out)]] == [full[: len(ids) + k] for k in range(len(out))]


def test_processor_failure_mid_decode_fails_at_its_own_token(model: llama.Model) -> None:
    def third_call_fails(tokens: mx.array, logits: mx.array) -> mx.array:
        third_call_fails.calls += 1
        if third_call_fails.calls == 3:
            raise RuntimeError("late failure")
        return logits

    third_call_fails.calls = 0
    stage = make_stage(model)
    params = greedy(10, logits_processors=[third_call_fails])
    stage.add("bad", LlmInput(prompt_token_ids=prompt(5), sampling_params=params))
    stage.add("mate", LlmInput(prompt_token_ids=prompt(7, 1), sampling_params=greedy(10)))
    got: list[Any] = []
    while stage.has_work():
        got += [o for o in stage.step() if o.request_id == "bad"]
    assert [o.payload is not None for o in got] == [True, True, False]
    assert "late failure" in got[-1].error
    assert got[1].payload.output_token_ids == solo(model, prompt(5), greedy(2))


def test_last_chunks_of_cached_sessions_share_one_padded_forward(model: llama.Model) -> None:
    # Two sessions with different cached lengths send their next turns in the same step.
    stage = make_stage(model)
    turns = {"s1": prompt(30), "s2": prompt(11, 4)}
    replies = {k: generate_keyed(stage, k, ids) for k, ids in turns.items()}
    nxt = {k: turns[k] + replies[k] + prompt(3 + 5 * i, i) for i, k in enumerate(turns)}
    for k, ids in nxt.items():
        stage.add(k, LlmInput(prompt_token_ids=ids, sampling_params=greedy(10), cache_key=k))
    outs = run(stage)
    for k, ids in nxt.items():
        assert outs[k][0].cached_tokens == len(turns[k]) + len(replies[k])
        assert outs[k][-1].output_token_ids == solo(model, ids, greedy(10))


def generate_keyed(stage: LlmStage, key: str, ids: list[int]) -> list[int]:
    stage.add(key, LlmInput(prompt_token_ids=ids, sampling_params=greedy(6), cache_key=key))
    return run(stage)[key][-1].output_token_ids


def test_long_and_short_last_chunks_are_prefilled_apart(model: llama.Model) -> None:
    stage = make_stage(model, prefill_chunk_tokens=64, max_tokens_per_step=128)
    stage.add("long", LlmInput(prompt_token_ids=prompt(60), sampling_params=greedy(6)))
    stage.add("short", LlmInput(prompt_token_ids=prompt(3, 1), sampling_params=greedy(6)))
    first = stage.step()
    assert {o.request_id for o in first} == {"long", "short"}  # both in one step
    outs = run(stage)
    assert outs["long"][-1].output_token_ids == solo(model, prompt(60), greedy(6))
    assert outs["short"][-1].output_token_ids == solo(model, prompt(3, 1), greedy(6))


def test_short_prompt_overtakes_a_long_prefill_and_the_long_one_still_finishes(
    model: llama.Model,
) -> None:
    stage = make_stage(
        model, prefill_chunk_tokens=32, prefill_slice_tokens=8, max_tokens_per_step=64
    )
    stage.add("long", LlmInput(prompt_token_ids=prompt(120), sampling_params=greedy(6)))
    stage.step()
    long_req = stage.request("long")
    assert long_req is not None and 0 < long_req.num_computed_tokens < 120  # mid-prefill
    stage.add("short", LlmInput(prompt_token_ids=prompt(5, 2), sampling_params=greedy(6)))
    first = stage.step()
    # The short prompt's first token comes from the very next step, before the long one's.
    assert [o.request_id for o in first] == ["short"]
    outs = run(stage)
    assert outs["long"][-1].finished  # not starved by the short one's decode
    assert outs["long"][-1].output_token_ids == solo(model, prompt(120), greedy(6))
    assert outs["short"][-1].output_token_ids == solo(model, prompt(5, 2), greedy(6))


def test_a_prompt_longer_than_a_step_advances_one_slice_per_step(model: llama.Model) -> None:
    stage = make_stage(
        model, prefill_chunk_tokens=32, prefill_slice_tokens=8, max_tokens_per_step=64
    )
    stage.add("long", LlmInput(prompt_token_ids=prompt(50), sampling_params=greedy(2)))
    computed = []
    while not stage.step():
        long_req = stage.request("long")
        assert long_req is not None
        computed.append(long_req.num_computed_tokens)
    # Slices of 8 (7 once the KV holds a few tokens), however much the step's chunk would
    # allow, until the rest (7) fits in one.
    assert computed == [8, 15, 22, 29, 36, 43]


def test_a_slice_shrinks_as_the_prompts_kv_grows(model: llama.Model) -> None:
    stage = make_stage(model, prefill_chunk_tokens=512, prefill_slice_tokens=64)
    sizes = [stage._scheduler._slice_at(depth) for depth in (0, 256, 512, 1024, 1536, 4096)]
    assert sizes == [64, 42, 32, 21, 16, 16]


def test_a_prefill_forward_gives_way_between_its_layers_and_decode_steps_run_whole() -> None:
    from engine.models import llama as ours

    mx.random.seed(0)
    args = tiny_model().args
    model = ours.Model(args)  # the project's own class: the one that pauses
    mx.eval(model.parameters())
    alone = generate(make_stage(model), prompt(40), greedy(6))
    stage = make_stage(model, prefill_slice_tokens=16)
    paused_at: list[int] = []
    stage.give_way_with(lambda: paused_at.append(stage.token_counts["decode"]))
    assert generate(stage, prompt(40), greedy(6)) == alone
    # Two slices of the prompt and its last chunk, each forward pausing after each
    # layer; none of the decode steps.
    assert len(paused_at) == 3 * args.num_hidden_layers
    assert set(paused_at) == {0}
