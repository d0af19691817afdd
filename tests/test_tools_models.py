"""Function calls with real models: the local LLM stage's grammar-held calls sharing one
batch with free rows, and the remote stage against a real `mlx_lm.server` that parses
tool calls, started by the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.config import RemoteLlmConfig
from engine.llm.remote_llm import RemoteLlm
from engine.llm.stage import LlmInput, LlmStage
from engine.runtime.request import RequestOutput, SamplingParams
from engine.weights.paths import cache_dir
from tests.helpers import ROOT, free_port, wait_until_serving

pytestmark = pytest.mark.models

MODEL_DIR = cache_dir() / "smollm2-135m-instruct-fp32"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather forecast", "parameters": SCHEMA},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
QUESTIONS = ["Weather in Paris?", "Will it rain in Oslo this week?", "Is it sunny in Rome?"]


@pytest.fixture(scope="module")
def stage() -> LlmStage:
    return LlmStage.from_path(MODEL_DIR, max_running_sequences=8)


def run(stage: LlmStage, requests: dict[str, LlmInput]) -> dict[str, list[RequestOutput]]:
    """Run `requests` to the end together; every step's rows must include all of them
    until the first finishes (they share the batch)."""
    for rid, inputs in requests.items():
        stage.add(rid, inputs)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    shared = False
    while stage.has_work():
        shared = shared or stage.stats()["running"] == len(requests)
        for out in stage.step():
            assert out.error is None, out.error
            outs[out.request_id].append(out.payload)
    assert shared, "the constrained and free rows never decoded in one batch"
    return outs


def chat(question: str, **fields: Any) -> LlmInput:
    params = SamplingParams(max_tokens=80, temperature=0.8, seed=len(question))
    messages = [{"role": "user", "content": question}]
    return LlmInput(messages=messages, sampling_params=params, **fields)


def the_call(outs: list[RequestOutput]) -> tuple[str, dict[str, Any]]:
    deltas = [d for out in outs for d in out.tool_calls]
    assert deltas and {d.index for d in deltas} == {0}
    (name,) = {d.name for d in deltas}
    assert "".join(out.new_text for out in outs) == ""  # a call is not text
    assert outs[-1].finished and outs[-1].finish_reason == "tool_calls"
    return name, json.loads("".join(d.arguments for d in deltas))


def test_forced_calls_validate_and_share_the_batch_with_free_rows(stage: LlmStage) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    requests = {
        f"required{i}": chat(q, tools=[WEATHER, TIME], tool_choice="required")
        for i, q in enumerate(QUESTIONS)
    }
    requests |= {
        f"named{i}": chat(q, tools=[WEATHER, TIME], tool_choice=named)
        for i, q in enumerate(QUESTIONS)
    }
    requests["free"] = chat("Tell me about the sea.")
    requests["none"] = chat("Weather in Paris?", tools=[WEATHER], tool_choice="none")
    outs = run(stage, requests)
    for rid in requests:
        if rid.startswith(("required", "named")):
            name, arguments = the_call(outs[rid])
            schema = SCHEMA if name == "get_weather" else TIME["function"]["parameters"]
            jsonschema.validate(arguments, schema)
            assert rid.startswith("required") or name == "get_weather"
    for rid in ("free", "none"):
        assert not any(out.tool_calls for out in outs[rid])
        assert "".join(out.new_text for out in outs[rid]).strip()


# ---- a real mlx_lm.server that parses tool calls ---------------------------------------

# The embedded SmolLM2's own template has no tools; this one (Hermes-style) renders them,
# and `tool_parser_type` makes mlx_lm.server parse `<tool_call>` blocks into `tool_calls`.
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}<|im_start|>system\n{{ m['content'] }}"
    "{% if tools %}\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>"
    "{% endif %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>tool\n{{ m['content'] }}<|im_end|>\n"
    "{%- elif m.get('tool_calls') %}<|im_start|>assistant\n{% for c in m['tool_calls'] %}"
    '<tool_call>\n{"name": "{{ c[\'function\'][\'name\'] }}", "arguments": '
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_model_dir(root: Path) -> Path:
    """The embedded model's files, its tokenizer config given the tool template."""
    for name in ("config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json"):
        (root / name).symlink_to(MODEL_DIR / name)
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    config.update(chat_template=TEMPLATE, tool_parser_type="json_tools")
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tool_model_dir(tmp_path_factory.mktemp("tool-model"))
    port = free_port()
    code = "import engine, sys; engine.setup(); from mlx_lm.server import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--model", str(model), "--host", "127.0.0.1"]
        + ["--port", str(port)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base + "/v1/models", 120)
        yield base + "/v1"
    finally:
        proc.terminate()
        proc.wait(30)


def asked_before(city: str) -> list[dict[str, Any]]:
    """A weather question, its call and its result: the pattern the model follows."""
    call = {
        "id": f"call_{city}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{city}", "content": "18 C"},
        {"role": "assistant", "content": f"18 C in {city}."},
    ]


async def test_remote_server_tool_calls_stream_back_as_deltas(tool_server: str) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    messages += asked_before("Paris") + asked_before("Rome")
    messages.append({"role": "user", "content": "What is the weather in Berlin?"})
    inputs = LlmInput(
        messages=messages,
        sampling_params=SamplingParams(max_tokens=60, temperature=0.0),
        tools=[tool],
        tool_choice="auto",
    )
    llm = RemoteLlm(RemoteLlmConfig(base_url=tool_server, model="default_model"))
    outs = [out async for out in llm.stream("r1", inputs)]
    await llm.aclose()
    assert all(out.error is None for out in outs)
    deltas = [d for out in outs for d in out.payload.tool_calls]
    assert deltas and {(d.index, d.name) for d in deltas} == {(0, "get_weather")}
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Berlin"}
    assert outs[-1].finished and outs[-1].payload.finish_reason == "tool_calls"
