"""Per-token cost of a JSON-schema token mask at batch 8: the structured-generation
libraries that install here, on the embedded SmolLM2's tokenizer, in the same run.

Each of 8 rows walks a schema-valid tool-call argument object token by token; per step
every row's mask is computed (the work the batcher adds per decode step) and the
row's token consumed. Printed: grammar compile time, and mask microseconds per step
for all 8 rows (median over the steps of `--repeats` walks). xgrammar is not measured:
its Python package imports torch (with the CUDA wheels, several GB) even on CPU.

    python bench/grammar_mask.py [--json] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from engine.weights.paths import cache_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "details": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
INSTANCE = (
    '{"location": "Paris, France", "unit": "celsius", "days": 3, "details": ["wind", "rain"]}'
)
ROWS = 8


def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cache_dir() / "smollm2-135m-instruct-fp32"))


def bench_llguidance(tok: Any, tokens: list[int], repeats: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA),
        defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    )
    llguidance.LLMatcher(lltok, grammar).compute_bitmask()
    t2 = time.perf_counter()
    steps: list[float] = []
    for _ in range(repeats):
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(ROWS)]
        mask = allocate_token_bitmask(ROWS, lltok.vocab_size)
        for token in tokens:
            t = time.perf_counter()
            for i, m in enumerate(matchers):
                fill_next_token_bitmask(m, mask, i)
            steps.append(time.perf_counter() - t)
            for m in matchers:
                assert m.consume_token(token), m.get_error()
    return _result(t0, t1, t2, steps)


def bench_outlines_core(tok: Any, tokens: list[int], repeats: int) -> dict[str, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    vocab = Vocabulary(tok.eos_token_id, _byte_vocab(tok))
    t1 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    t2 = time.perf_counter()
    words = (len(tok) + 31) // 32
    steps: list[float] = []
    for _ in range(repeats):
        guides = [Guide(index) for _ in range(ROWS)]
        mask = np.zeros((ROWS, words), dtype=np.int32)
        for token in tokens:
            t = time.perf_counter()
            for i, g in enumerate(guides):
                row = mask[i]
                g.write_mask_into(row.ctypes.data, row.size, row.itemsize)
            steps.append(time.perf_counter() - t)
            for g in guides:
                g.advance(token)
    return _result(t0, t1, t2, steps)


def _result(t0: float, t1: float, t2: float, steps: list[float]) -> dict[str, float]:
    """Vocabulary setup (once per process), one schema's compile (once per tool set)
    and the median mask time of one decode step for all rows."""
    return {
        "vocab_setup_ms": round((t1 - t0) * 1000, 1),
        "schema_compile_ms": round((t2 - t1) * 1000, 1),
        "mask_us_per_step": _us(steps),
    }


def _byte_vocab(tok: Any) -> dict[bytes, list[int]]:
    """Byte-level BPE tokens as the bytes they stand for (outlines-core's input)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tok.all_special_ids)
    vocab: dict[bytes, list[int]] = {}
    for text, token_id in tok.get_vocab().items():
        if token_id in special:
            continue
        raw = bytes(to_byte[c] for c in text) if all(c in to_byte for c in text) else text.encode()
        vocab.setdefault(raw, []).append(token_id)
    return vocab


def _us(steps: list[float]) -> float:
    return round(statistics.median(steps) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tok = hf_tokenizer()
    tokens = tok.encode(INSTANCE)
    result: dict[str, Any] = {"rows": ROWS, "tokens_per_walk": len(tokens)}
    result["llguidance"] = bench_llguidance(tok, tokens, args.repeats)
    result["outlines_core"] = bench_outlines_core(tok, tokens, args.repeats)
    result["xgrammar"] = "not measured: its Python package imports torch"
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
