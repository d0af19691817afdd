"""Function calling through the gateway (started through its CLI, real models), over the
realtime protocol, in text:

- `call_precision`, `call_recall`: with `tool_choice: "auto"` on 24 prompts of our own,
  12 of which ask for something one of the three tools does; a prompt counts as called
  when its response holds a `function_call`. The model alone decides (no keyword rules).
- `held_out_precision`, `held_out_recall`: the same on 24 more prompts of other wordings,
  a second look at a profile's `call_threshold` (the quality profile's was chosen with
  both sets in view: bench/RESULTS.md).
- `schema_valid_rate`: every call made (the auto run, then a `required` run over all
  24 prompts) checked against its function's parameter schema with `jsonschema`.
- `first_call_ms_p50`/`_p90`: from sending `response.create` (with `required`) to
  `response.function_call_arguments.done`, one prompt at a time.

Sampling is the profile's, at `--temperature` (0 by default: the figures then repeat).

    python bench/tools.py [--json] [--config PROFILE] [--temperature 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gateway import gateway_process, recv_until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "set_timer",
        "description": "Start a countdown timer",
        "parameters": {
            "type": "object",
            "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 600}},
            "required": ["minutes"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
SHOULD_CALL = [
    "What is the weather in Paris right now?",
    "Is it raining in London today?",
    "How hot is it in Cairo?",
    "Tell me the weather forecast for Tokyo in fahrenheit.",
    "Set a timer for ten minutes.",
    "Start a five minute countdown, please.",
    "Remind me in twenty minutes with a timer.",
    "What time is it in New York?",
    "Can you tell me the local time in Sydney?",
    "What is the current time in Berlin?",
    "I need a timer for 45 minutes.",
    "Check the weather in Madrid for me.",
]
SHOULD_NOT_CALL = [
    "What is the capital of France?",
    "Tell me a short joke.",
    "How are you today?",
    "Who wrote Romeo and Juliet?",
    "What is two plus two?",
    "Say hello to my friend Sam.",
    "What colour is the sky on a clear day?",
    "Give me a word that rhymes with cat.",
    "Thank you, that is all.",
    "Describe a cat in one sentence.",
    "Why do leaves fall in autumn?",
    "Translate good morning into Spanish.",
]

HELD_OUT_CALL = [
    "How's the weather looking in Rome this afternoon?",
    "Do I need an umbrella in Seattle today?",
    "What's the temperature in Moscow in celsius?",
    "Could you start a timer for three minutes?",
    "Time my tea for four minutes.",
    "Set a countdown for an hour and a half.",
    "What's the time in Tokyo right now?",
    "Is it morning or night in Los Angeles now?",
    "Tell me the current time in Dubai.",
    "Put a two minute timer on.",
    "Weather in Oslo, please.",
    "Is it sunny in Lisbon?",
]
HELD_OUT_NOT = [
    "What is the boiling point of water?",
    "How many legs does a spider have?",
    "What's your name?",
    "What is seven times eight?",
    "Can you recommend a good book?",
    "What does a kitchen timer do?",
    "Who was the first person on the moon?",
    "Spell the word weather.",
    "Good night!",
    "What is the largest ocean?",
    "Tell me a fun fact about clocks.",
    "How do I say thank you in French?",
]


async def ask(url: str, prompt: str, choice: str) -> tuple[list[dict[str, Any]], float | None]:
    """One prompt in a fresh session: its response's function calls, and the ms from
    `response.create` to the first call's `function_call_arguments.done`."""
    async with connect(url, max_size=None) as ws:
        session = {
            "type": "realtime",
            "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
            "tools": TOOLS,
            "tool_choice": choice,
        }
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        await recv_until(ws, "session.updated")
        content = [{"type": "input_text", "text": prompt}]
        item = {"type": "message", "role": "user", "content": content}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await recv_until(ws, "conversation.item.done")
        start = time.perf_counter()
        await ws.send(json.dumps({"type": "response.create"}))
        first_ms = None
        calls = []
        for event in await recv_until(ws, "response.done"):
            if event["type"] == "response.function_call_arguments.done":
                calls.append(event)
                if first_ms is None:
                    first_ms = (time.perf_counter() - start) * 1000
        return calls, first_ms


def valid(call: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def precision_recall(
    called: dict[str, bool], should: list[str], should_not: list[str]
) -> tuple[float, float]:
    true_pos = sum(called[p] for p in should)
    false_pos = sum(called[p] for p in should_not)
    return round(true_pos / max(true_pos + false_pos, 1), 3), round(true_pos / len(should), 3)


async def measure(url: str) -> dict[str, Any]:
    prompts = SHOULD_CALL + SHOULD_NOT_CALL
    calls: list[dict[str, Any]] = []
    called: dict[str, bool] = {}
    for prompt in prompts + HELD_OUT_CALL + HELD_OUT_NOT:
        made, _ = await ask(url, prompt, "auto")
        called[prompt] = bool(made)
        calls += made
    precision, recall = precision_recall(called, SHOULD_CALL, SHOULD_NOT_CALL)
    held_precision, held_recall = precision_recall(called, HELD_OUT_CALL, HELD_OUT_NOT)
    first_ms = []
    for prompt in prompts:
        made, ms = await ask(url, prompt, "required")
        calls += made
        if ms is not None:
            first_ms.append(ms)
    return {
        "prompts": len(prompts),
        "should_call": len(SHOULD_CALL),
        "auto_called": sum(called[p] for p in prompts),
        "call_precision": precision,
        "call_recall": recall,
        "held_out_precision": held_precision,
        "held_out_recall": held_recall,
        "calls_checked": len(calls),
        "required_responses_with_a_call": len(first_ms),
        "schema_valid_rate": round(sum(valid(c) for c in calls) / max(len(calls), 1), 3),
        "first_call_ms_p50": round(statistics.median(first_ms), 1),
        "first_call_ms_p90": round(statistics.quantiles(first_ms, n=10)[-1], 1),
        "auto_called_prompts": [p for p in called if called[p]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    profile = yaml.safe_load(args.config.read_text())
    profile["stages"]["llm"]["sampling"]["temperature"] = args.temperature
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "profile.yaml"
        path.write_text(yaml.safe_dump(profile))
        with gateway_process("--config", str(path)) as gw:
            result = asyncio.run(measure(gw.realtime_url))
    result["temperature"] = args.temperature
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
