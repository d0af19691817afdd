"""Answer quality through the gateway (started through its CLI, real models), over the
realtime protocol, in text: 45 conversations of our own, scored by rule.

Four kinds: facts (14), arithmetic (10), memory of the conversation (10: a fact told in
an earlier turn, asked for in the last) and instruction following (11: one-word, yes/no,
repeat, count, spell...). Each conversation runs in a fresh session with the profile's
own instructions; each user turn is `conversation.item.create` + `response.create`, and
only the last answer is scored: it passes when it matches the case's pattern (case
folded) and, where a case says so, has at most `max_words` words. The profiles run one
after the other in the same sitting, the default profile first.

    python bench/quality.py [--json] [--profile default --profile quality]
                            [--profile quality:qwen2.5-coder-1.5b-instruct]
                            [--temperature 0] [--max-tokens N] [--limit N]

`--profile NAME:LLM` runs profile NAME with the registry's model LLM in its LLM stage.

Sampling is each profile's, at `--temperature` (0 by default: the figures repeat) and,
if given, `--max-tokens` for every profile (a shorter cap saves minutes on a slow CPU;
every case's answer fits in 48 tokens).
`--limit N` runs the first N cases of each kind (a quick look).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gateway import gateway_process, recv_until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    kind: str
    turns: tuple[str, ...]
    pattern: str  # a regular expression the last answer must contain (case folded)
    max_words: int | None = None

    def passes(self, answer: str) -> bool:
        if not re.search(self.pattern, answer, re.IGNORECASE | re.DOTALL):
            return False
        return self.max_words is None or len(re.findall(r"[\w'-]+", answer)) <= self.max_words


def _case(kind: str, *turns: str, pattern: str, max_words: int | None = None) -> Case:
    return Case(kind, turns, pattern, max_words)


CASES = [
    _case("facts", "What is the capital of France?", pattern=r"\bparis\b"),
    _case("facts", "What is the capital of Japan?", pattern=r"\btokyo\b"),
    _case("facts", "How many days are there in a week?", pattern=r"\b(7|seven)\b"),
    _case("facts", "What is the largest planet in our solar system?", pattern=r"jupiter"),
    _case("facts", "Who wrote Romeo and Juliet?", pattern=r"shakespeare"),
    _case("facts", "What is the chemical formula of water?", pattern=r"h2o|h₂o"),
    _case("facts", "How many continents are there on Earth?", pattern=r"\b(7|seven)\b"),
    _case("facts", "What colour do you get when you mix blue and yellow?", pattern=r"green"),
    _case(
        "facts",
        "At what temperature does water freeze, in degrees Celsius?",
        pattern=r"\b(0|zero)\b",
    ),
    _case("facts", "Which is the largest ocean on Earth?", pattern=r"pacific"),
    _case("facts", "What is the opposite of hot?", pattern=r"\bcold\b"),
    _case("facts", "How many legs does a spider have?", pattern=r"\b(8|eight)\b"),
    _case("facts", "In which country is the Eiffel Tower?", pattern=r"\bfrance\b"),
    _case(
        "facts",
        "Which gas do plants take in from the air to make food?",
        pattern=r"carbon dioxide|co2|co₂",
    ),
    _case("arithmetic", "What is seven plus five?", pattern=r"\b(12|twelve)\b"),
    _case("arithmetic", "What is nine times six?", pattern=r"\b(54|fifty[- ]four)\b"),
    _case(
        "arithmetic",
        "I have two apples and buy three more. How many apples do I have now?",
        pattern=r"\b(5|five)\b",
    ),
    _case("arithmetic", "What is 100 minus 37?", pattern=r"\b(63|sixty[- ]three)\b"),
    _case("arithmetic", "What is half of fifty?", pattern=r"\b(25|twenty[- ]five)\b"),
    _case("arithmetic", "What is twelve divided by four?", pattern=r"\b(3|three)\b"),
    _case(
        "arithmetic",
        "How many minutes are there in two hours?",
        pattern=r"\b(120|(one )?hundred (and )?twenty)\b",
    ),
    _case(
        "arithmetic",
        "I had a dozen eggs and used four. How many eggs are left?",
        pattern=r"\b(8|eight)\b",
    ),
    _case("arithmetic", "What is 15 plus 27?", pattern=r"\b(42|forty[- ]two)\b"),
    _case("arithmetic", "What is three squared?", pattern=r"\b(9|nine)\b"),
    _case("memory", "Hi, my name is Priya.", "What is my name?", pattern=r"\bpriya\b"),
    _case("memory", "I live in Lisbon.", "In which city do I live?", pattern=r"\blisbon\b"),
    _case(
        "memory",
        "My favourite colour is green.",
        "What is my favourite colour?",
        pattern=r"\bgreen\b",
    ),
    _case("memory", "I have a dog called Max.", "What is my dog's name?", pattern=r"\bmax\b"),
    _case(
        "memory",
        "Please remember the number 42.",
        "Which number did I ask you to remember?",
        pattern=r"\b(42|forty[- ]two)\b",
    ),
    _case(
        "memory",
        "My sister is called Ana and my brother is called Tom.",
        "What is my brother called?",
        pattern=r"\btom\b",
    ),
    _case(
        "memory",
        "I am 30 years old.",
        "How old will I be next year?",
        pattern=r"\b(31|thirty[- ]one)\b",
    ),
    _case("memory", "I work as a nurse.", "What is my job?", pattern=r"\bnurse\b"),
    _case(
        "memory",
        "My name is Omar and I live in Cairo.",
        "Thanks. Where do I live?",
        pattern=r"\bcairo\b",
    ),
    _case(
        "memory",
        "I bought three apples.",
        "I ate one of them.",
        "How many apples do I have left?",
        pattern=r"\b(2|two)\b",
    ),
    _case(
        "instructions",
        "Answer with just one word: what colour is the sky on a clear day?",
        pattern=r"\bblue\b",
        max_words=2,
    ),
    _case(
        "instructions",
        "Reply with only yes or no: is the Sun a star?",
        pattern=r"^\W*yes\W*$",
    ),
    _case("instructions", "Reply with only yes or no: is ice hot?", pattern=r"^\W*no\W*$"),
    _case("instructions", "Say the word banana and nothing else.", pattern=r"^\W*banana\W*$"),
    _case(
        "instructions",
        "Count from one to five.",
        pattern=r"(one|1)\W+(two|2)\W+(three|3)\W+(four|4)\W+(five|5)",
    ),
    _case(
        "instructions",
        "Name three fruits, separated by commas.",
        pattern=r"^[^,]+,[^,]+,[^,]+$",
        max_words=12,
    ),
    _case(
        "instructions",
        "Spell the word cat letter by letter.",
        pattern=r"\bc\b\W+\ba\b\W+\bt\b",
    ),
    _case(
        "instructions",
        "Repeat after me: the quick brown fox.",
        pattern=r"the quick brown fox",
        max_words=8,
    ),
    _case(
        "instructions",
        "Give me a number between one and ten, written as a digit.",
        pattern=r"\b([1-9]|10)\b",
        max_words=6,
    ),
    _case(
        "instructions",
        "What is the first letter of the English alphabet? Answer with the letter only.",
        pattern=r"^\W*a\W*$",
    ),
    _case(
        "instructions",
        "In at most five words: what do bees make?",
        pattern=r"honey",
        max_words=5,
    ),
]


async def conversation(url: str, case: Case) -> tuple[str, float]:
    """Run `case` in a fresh session; its last answer and that answer's seconds."""
    async with connect(url, max_size=None) as ws:
        session = {
            "type": "realtime",
            "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
        }
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        await recv_until(ws, "session.updated")
        answer, seconds = "", 0.0
        for turn in case.turns:
            answer, seconds = await _turn(ws, turn)
        return answer, seconds


async def _turn(ws: ClientConnection, text: str) -> tuple[str, float]:
    content = [{"type": "input_text", "text": text}]
    item = {"type": "message", "role": "user", "content": content}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await recv_until(ws, "conversation.item.done")
    start = time.perf_counter()
    await ws.send(json.dumps({"type": "response.create"}))
    events = await recv_until(ws, "response.done")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    return answer.strip(), time.perf_counter() - start


async def measure(url: str, cases: list[Case]) -> dict[str, Any]:
    results = []
    for n, case in enumerate(cases, 1):
        answer, seconds = await conversation(url, case)
        results.append((case, answer, seconds, case.passes(answer)))
        # Progress on stderr: a slow profile takes many minutes.
        print(f"{n}/{len(cases)} {results[-1][3]!s:5} {answer[:60]!r}", file=sys.stderr)
    by_kind: dict[str, list[bool]] = {}
    for case, _, _, passed in results:
        by_kind.setdefault(case.kind, []).append(passed)
    return {
        "cases": len(cases),
        "score": round(sum(r[3] for r in results) / len(results), 3),
        "by_kind": {k: round(sum(v) / len(v), 3) for k, v in by_kind.items()},
        "answer_s_mean": round(sum(r[2] for r in results) / len(results), 2),
        "failed": [{"asked": r[0].turns[-1], "answer": r[1]} for r in results if not r[3]],
    }


def selected(limit: int | None) -> list[Case]:
    if limit is None:
        return list(CASES)
    counts: dict[str, int] = {}
    out = []
    for case in CASES:
        counts[case.kind] = counts.get(case.kind, 0) + 1
        if counts[case.kind] <= limit:
            out.append(case)
    return out


def run_profile(
    name: str, temperature: float, max_tokens: int | None, cases: list[Case]
) -> dict[str, Any]:
    name, _, llm = name.partition(":")
    profile = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    sampling = profile["stages"]["llm"]["sampling"]
    sampling["temperature"] = temperature
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    if llm:
        profile["stages"]["llm"]["model"]["name"] = llm
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "profile.yaml"
        path.write_text(yaml.safe_dump(profile))
        with gateway_process("--config", str(path)) as gw:
            result = asyncio.run(measure(gw.realtime_url, cases))
    return {"llm": profile["stages"]["llm"]["model"], **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", action="append", help="default: default and quality")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, help="every profile's answer cap")
    parser.add_argument("--limit", type=int, help="the first N cases of each kind")
    args = parser.parse_args()
    cases = selected(args.limit)
    result: dict[str, Any] = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    for name in args.profile or ["default", "quality"]:
        result[name] = run_profile(name, args.temperature, args.max_tokens, cases)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
