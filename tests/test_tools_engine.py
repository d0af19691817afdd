"""Function calls below the gateway: the local call format and its reader, the grammar
mask (on a small byte-level tokenizer built here, and on the real SmolLM2 and
Qwen2.5-Coder tokenizers from the model cache), the remote stage's forwarding and delta mapping,
and the orchestrator's call outputs, which are never spoken."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import mlx.core as mx
import pytest

from duplex.turn import Message, Stage, Tool, ToolCall, ToolChoice, TurnRequest
from engine.config import RemoteLlmConfig, parse_config
from engine.llm.remote_llm import RemoteLlm, chat_body
from engine.llm.stage import LlmInput
from engine.llm.tool_calls import (
    BARE_OPEN,
    CallReader,
    call_text,
    native_messages,
    renders_tools,
    template_messages,
)
from engine.runtime.request import RequestOutput, ToolCallDelta
from engine.runtime.stage import StageOutput
from engine.weights.paths import cache_dir
from tests.fake_engine import Harness

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def read(pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    reader = CallReader()
    text, calls = "", []
    for piece in pieces:
        t, c = reader.push(piece)
        text, calls = text + t, calls + c
    t, c = reader.finish()
    return text + t, calls + c


# ---- the call format -----------------------------------------------------------------


def test_plain_replies_pass_through_the_reader() -> None:
    assert read(["Hello", " there"]) == ("Hello there", [])
    assert read(["<", "tooling is fun"]) == ("<tooling is fun", [])
    assert read(["<tool"]) == ("<tool", [])  # ended undecided: it was text


def test_a_call_is_read_into_deltas_and_no_text() -> None:
    whole = call_text("get_weather", '{"city": "Paris", "unit": "celsius"}')
    text, calls = read([whole[i : i + 3] for i in range(0, len(whole), 3)])
    assert text == ""
    assert {c.name for c in calls} == {"get_weather"} and {c.index for c in calls} == {0}
    assert calls[0].arguments == ""  # the name is announced before the arguments
    assert "".join(c.arguments for c in calls) == '{"city": "Paris", "unit": "celsius"}'


def test_a_bare_call_object_is_a_call_too() -> None:
    # Qwen2.5-Coder, shown the tools by its own template, often leaves the tags out.
    whole = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    text, calls = read([whole[i : i + 4] for i in range(0, len(whole), 4)])
    assert text == "" and {c.name for c in calls} == {"get_weather"}
    assert "".join(c.arguments for c in calls) == '{"city": "Paris", "unit": "celsius"}'
    assert read(['{"nam', 'ing": 1}']) == ('{"naming": 1}', [])  # other JSON is text


def test_a_call_object_in_a_json_code_block_is_read_once_it_ends() -> None:
    block = '```json\n{\n  "name": "set_timer",\n  "arguments": {\n    "minutes": 10\n  }\n}\n```'
    reader = CallReader()
    assert all(reader.push(block[i : i + 5]) == ("", []) for i in range(0, len(block), 5))
    assert reader.finish() == ("", [ToolCallDelta(0, "set_timer", '{"minutes": 10}')])
    assert reader.called
    other = '```json\n{"colour": "blue"}\n```'
    assert read([other]) == (other, [])  # a code block that holds no call is text
    assert read(["```python\nprint(1)\n```"]) == ("```python\nprint(1)\n```", [])


def test_a_call_cut_off_by_the_token_limit_keeps_what_was_written() -> None:
    whole = call_text("get_weather", '{"city": "Par')
    text, calls = read([whole[: -len("}\n</tool_call>")]])
    assert text == "" and "".join(c.arguments for c in calls) == '{"city": "Par'


def test_the_template_shows_tools_calls_and_results() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    system, user, assistant, result = template_messages(messages, [WEATHER])
    assert system["content"].startswith("Be brief.\n\n") and '"get_weather"' in system["content"]
    assert user == {"role": "user", "content": "Weather?"}
    assert assistant["content"] == call_text("get_weather", '{"city": "Oslo"}')
    assert result["role"] == "user"
    assert result["content"].startswith("<tool_response>\ncold\n</tool_response>\n")
    # Without tools offered the system message is left as it is.
    assert template_messages(messages, [])[0] == {"role": "system", "content": "Be brief."}
    # A template that renders tools itself gets the messages as they are, each call's
    # arguments as the object it writes out.
    native = native_messages(messages)
    assert native[0] == messages[0] and native[3] == messages[3]
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


@pytest.mark.models
def test_qwens_own_template_presents_the_tools() -> None:
    from transformers import AutoTokenizer

    from engine.weights import registry

    qwen = AutoTokenizer.from_pretrained(str(registry.prepare("qwen2.5-coder-0.5b-instruct")))
    smollm2 = AutoTokenizer.from_pretrained(str(cache_dir() / "smollm2-135m-instruct-fp32"))
    assert renders_tools(qwen) and not renders_tools(smollm2)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = qwen.apply_chat_template(
        native_messages(messages), tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt
    assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")


# ---- the grammar mask on a real tokenizer ----------------------------------------------


def small_tokenizer() -> Any:
    """A byte-level BPE tokenizer of the same kind as SmolLM2's (multi-character tokens,
    any text encodable), trained here on call texts: no model cache needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [
        call_text("get_weather", '{"city": "Rome", "unit": "celsius"}'),
        call_text("get_time", "{}"),
        "Sure, the weather in Oslo is fine today.",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")


@pytest.fixture(
    scope="module",
    params=[
        "small",
        pytest.param("smollm2", marks=pytest.mark.models),
        pytest.param("qwen", marks=pytest.mark.models),
    ],
)
def grammar(request: pytest.FixtureRequest) -> Any:
    from transformers import AutoTokenizer

    from engine.llm.grammar import CallGrammar
    from engine.weights import registry

    if request.param == "small":
        tokenizer = small_tokenizer()
    elif request.param == "smollm2":  # the embedded LLM's, from the model cache
        tokenizer = AutoTokenizer.from_pretrained(str(cache_dir() / "smollm2-135m-instruct-fp32"))
    else:  # the quality profile's: `<tool_call>` and `</tool_call>` are special tokens
        path = registry.prepare("qwen2.5-coder-0.5b-instruct", progress=False)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return tokenizer, CallGrammar(tokenizer, [tokenizer.eos_token_id])


def test_a_forced_call_admits_only_valid_tokens_and_then_the_end(grammar: Any) -> None:
    tokenizer, calls = grammar
    prompt = [1, 2, 3]
    mask = calls.mask([WEATHER, TIME], len(prompt), forced=True)
    # A forced call is written in the tags (its arguments stream), never as a code block.
    opening = mask(mx.array(prompt), mx.zeros((1, calls.vocab_size)))
    assert not mx.isfinite(opening[0, tokenizer.encode("```json")[0]]).item()
    good = tokenizer.encode(call_text("get_weather", '{"city": "Rome", "unit": "celsius"}'))
    history = list(prompt)
    for token in good:
        logits = mask(mx.array(history), mx.zeros((1, calls.vocab_size)))
        assert logits[0, token].item() == 0, tokenizer.decode([token])
        history.append(token)
    logits = mask(mx.array(history), mx.zeros((1, calls.vocab_size)))
    finite = mx.isfinite(logits[0])
    assert finite.sum().item() == 1 and finite[tokenizer.eos_token_id].item()
    # A value outside the enum is masked out where it would start.
    bad = tokenizer.encode(call_text("get_weather", '{"city": "Rome", "unit": "kelvin"}'))
    mask = calls.mask([WEATHER], len(prompt), forced=True)
    history = list(prompt)
    for token in bad:
        logits = mask(mx.array(history), mx.zeros((1, calls.vocab_size)))
        if not mx.isfinite(logits[0, token]).item():
            break
        history.append(token)
    else:
        pytest.fail("the grammar let an argument outside the schema through")
    assert "kel" in tokenizer.decode(bad[len(history) - len(prompt) :])


def test_a_dropped_draw_rolls_the_mask_back(grammar: Any) -> None:
    tokenizer, calls = grammar
    mask = calls.mask([WEATHER], 0, forced=True)
    tokens = tokenizer.encode(call_text("get_weather", '{"city": "Rome", "unit": "celsius"}'))
    first = mask(mx.array(tokens[:5]), mx.zeros((1, calls.vocab_size)))
    mask(mx.array(tokens[:9]), mx.zeros((1, calls.vocab_size)))
    again = mask(mx.array(tokens[:5]), mx.zeros((1, calls.vocab_size)))
    assert mx.array_equal(first, again).item()


def test_auto_leaves_plain_replies_alone_and_holds_calls_to_the_grammar(grammar: Any) -> None:
    tokenizer, calls = grammar
    logits = mx.arange(calls.vocab_size, dtype=mx.float32)[None, :]
    plain = calls.mask([WEATHER], 0, forced=False)
    assert mx.array_equal(plain(mx.array([], dtype=mx.int32), logits), logits).item()
    assert mx.array_equal(plain(mx.array(tokenizer.encode("Sure")), logits), logits).item()
    # Tagged, bare, or in a code block: only the offered name can follow.
    for opening in ('<tool_call>\n{"name": "get_', '{"name": "get_', '```json\n{"name": "get_'):
        calling = calls.mask([WEATHER], 0, forced=False)
        masked = calling(mx.array(tokenizer.encode(opening)), logits)
        finite = {i for i in range(calls.vocab_size) if mx.isfinite(masked[0, i]).item()}
        assert finite and all(tokenizer.decode([i]) in "weather" for i in finite), opening


@pytest.mark.parametrize(
    ("share", "threshold", "calls"), [(0.3, 0.25, True), (0.2, 0.25, False), (0.45, 0.0, False)]
)
def test_auto_calls_when_the_first_token_leans_to_a_call_by_the_threshold(
    grammar: Any, share: float, threshold: float, calls: bool
) -> None:
    tokenizer, grammars = grammar
    text, opening = tokenizer.encode("Sure")[0], tokenizer.encode(BARE_OPEN)[0]
    # Two tokens hold all the probability: a plain word, and one that starts a call.
    logits = mx.full((1, grammars.vocab_size), -40.0)
    logits[0, text] = 0.0
    logits[0, opening] = math.log(share / (1 - share))
    mask = grammars.mask([WEATHER], 0, forced=False, call_threshold=threshold)
    first = mask(mx.array([], dtype=mx.int32), logits)
    if calls:  # the grammar holds from the first token: the plain word is out
        assert not mx.isfinite(first[0, text]).item()
        assert first[0, opening].item() == logits[0, opening].item()
    else:  # the model's own draw decides: nothing is masked
        assert mx.array_equal(first, logits).item()


# ---- the remote stage ------------------------------------------------------------------


def _inputs(**fields: Any) -> LlmInput:
    return LlmInput(messages=[{"role": "user", "content": "Weather in Oslo?"}], **fields)


def test_tools_and_choice_are_forwarded() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = chat_body("m", _inputs(tools=[WEATHER, TIME], tool_choice=choice))
    assert body["tools"] == [WEATHER, TIME] and body["tool_choice"] == choice
    assert "tools" not in chat_body("m", _inputs())


def _sse(*chunks: dict[str, Any]) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    return "".join([*lines, "data: [DONE]\n\n"]).encode()


def _calls(*entries: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    delta = {"tool_calls": list(entries)}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def _stream(body: bytes) -> list[StageOutput]:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    config = RemoteLlmConfig(base_url="http://server.test/v1", model="m")
    llm = RemoteLlm(config, transport=httpx.MockTransport(handler))
    outs = [o async for o in llm.stream("r1", _inputs(tools=[WEATHER]))]
    await llm.aclose()
    return outs


async def test_streamed_tool_call_deltas_are_mapped() -> None:
    body = _sse(
        _calls({"index": 0, "id": "x", "type": "function", "function": {"name": "get_weather"}}),
        _calls({"index": 0, "function": {"arguments": '{"city": '}}),
        _calls({"index": 1, "id": "y", "function": {"name": "get_time", "arguments": "{}"}}),
        _calls({"index": 0, "function": {"arguments": '"Oslo"}'}}, finish="tool_calls"),
    )
    outs = await _stream(body)
    deltas = [d for o in outs for d in o.payload.tool_calls]
    assert [(d.index, d.name, d.arguments) for d in deltas] == [
        (0, "get_weather", ""),
        (0, "get_weather", '{"city": '),
        (1, "get_time", "{}"),
        (0, "get_weather", '"Oslo"}'),
    ]
    final = outs[-1]
    assert final.finished and final.payload.finish_reason == "tool_calls"
    assert all(o.payload.new_text == "" for o in outs)


async def test_arguments_before_a_name_fail_the_request() -> None:
    outs = await _stream(_sse(_calls({"index": 0, "function": {"arguments": "{}"}})))
    assert outs[-1].finished and "before its name" in (outs[-1].error or "")


# ---- the orchestrator --------------------------------------------------------------------


class CallingLlm:
    """An `LlmBackend` whose reply is one call, in three pieces."""

    def __init__(self) -> None:
        self.inputs: list[LlmInput] = []

    async def _replies(self, request_id: str) -> AsyncIterator[StageOutput]:
        for piece in ["", '{"city": ', '"Oslo", "unit": "celsius"}']:
            delta = ToolCallDelta(0, "get_weather", piece)
            yield StageOutput(request_id, RequestOutput(request_id, tool_calls=[delta]))
        done = RequestOutput(request_id, finished=True, finish_reason="tool_calls")
        yield StageOutput(request_id, done, finished=True)

    def stream(self, request_id: str, inputs: LlmInput) -> AsyncIterator[StageOutput]:
        self.inputs.append(inputs)
        return self._replies(request_id)

    def abort(self, request_id: str) -> None:
        """Its replies are whole at once: nothing runs to stop."""


async def test_a_spoken_turn_that_calls_says_nothing() -> None:
    llm = CallingLlm()
    h = Harness(parse_config({}), llm=llm)
    try:
        tool = Tool("get_weather", "Weather", json.dumps(WEATHER_SCHEMA))
        call = ToolCall("call_1", "get_weather", '{"city": "Rome", "unit": "celsius"}')
        history = (
            Message("user", "Weather in Rome?"),
            Message("assistant", "", tool_calls=(call,)),
            Message("tool", "warm", tool_call_id="call_1"),
        )
        contexts = h.reserve(entry=1)
        request = TurnRequest(
            final=Stage.TTS,
            text="And in Oslo?",
            messages=history,
            tools=(tool,),
            tool_choice=ToolChoice("required"),
        )
        await h.submit(contexts, request)
        llm_id, tts_id = contexts[0].request_id, contexts[1].request_id
        await h.until(lambda: h.finished(tts_id))
        await h.idle()
        calls = [o for o in h.of(llm_id) if o.kind == "tool_call"]
        assert "".join(o.text for o in calls) == '{"city": "Oslo", "unit": "celsius"}'
        assert {(o.metadata["index"], o.metadata["name"]) for o in calls} == {(0, "get_weather")}
        assert [o.kind for o in h.of(tts_id)] == ["done"]  # nothing spoken
        assert h.tts.requests == {}
        (inputs,) = llm.inputs
        assert inputs.tools == [WEATHER] and inputs.tool_choice == "required"
        messages = inputs.messages or []
        assert messages[2]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert messages[3] == {"role": "tool", "content": "warm", "tool_call_id": "call_1"}
    finally:
        h.core.shutdown()
