"""Tool-call arguments that always validate: a grammar over the call's text, applied as
a per-request logits processor, so constrained and free rows share one decode batch.

The grammar (llguidance, a Lark grammar with a `%json` schema per function) spells the
whole call exactly as `engine.llm.tool_calls` reads it: `<tool_call>`, the name of one of the
offered functions, arguments valid against that function's parameter schema, and
`</tool_call>`, then only the end-of-turn token. llguidance was chosen over outlines-core
by measurement (bench/grammar_mask.py): both mask a batch of 8 in well under a tenth of
a millisecond, against tens of milliseconds for a decode step, but llguidance compiles a
schema about 14x faster (2 ms against 34 ms), which a new tool set pays on its first
call, and it takes the call's wrapper and several schemas as one grammar.

`CallMask` is the processor. With a forced call (`required` or a named function) the
grammar holds from the reply's first token. With `auto` the model writes freely and
the grammar takes over only once the reply starts as a call (`<tool_call>`, `{"name": "`
or a JSON code block): the model alone decides whether to call, and what it calls is
then valid. A forced call is written in the tags, so its arguments stream.

A model may under-call: Qwen2.5-Coder-1.5B, asked for the weather, gives starting a call
0.08 to 0.23 of its probability and then describes the call in words. With a
`call_threshold`, the reply is a call when, at its first token, the model gives the
tokens that can start one (the grammar's first tokens) at least that share of its
probability; the model still picks the form, the function and the arguments.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, cast

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from engine.llm.tool_calls import BARE_OPEN, CALL_OPEN, FENCE_OPEN, call_prefix

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# How a reply that is a call starts: in the tags, the bare call object, or a code block.
_OPENINGS = (CALL_OPEN, BARE_OPEN, FENCE_OPEN)

__all__ = ["CallGrammar", "CallMask"]

# The separators `engine.llm.tool_calls` reads, and no free whitespace.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark(tools: Sequence[dict[str, Any]], tags: tuple[str, str], *, forced: bool) -> str:
    """Per function, its call's fixed text, then its arguments' schema, inside the call
    tags (`tags`: the grammar's terms for them, `_tag_terms`). Unless the call is forced
    (written in the tags, so its arguments stream), also the model's other forms
    (`engine.llm.tool_calls`): the bare object, and the whole object spaced freely in a
    JSON code block."""
    rules, names = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = dict(function.get("parameters") or {"type": "object"})
        schema["x-guidance"] = _JSON_STYLE
        prefix = call_prefix(function["name"])
        tagged = json.dumps(prefix.removeprefix(OPEN_TAG))
        rules.append(f"call_{i}: open {tagged} args_{i} {json.dumps(chr(125) + chr(10))} end")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
        names.append(f"call_{i}")
        if forced:
            continue
        bare = json.dumps(prefix.removeprefix(CALL_OPEN))
        rules.append(f"bare_{i}: {bare} args_{i} {json.dumps(chr(125))}")
        fence, fence_end = json.dumps(FENCE_OPEN), json.dumps(chr(10) + "```")
        rules.append(f"fenced_{i}: {fence} object_{i} {fence_end}")
        rules.append(f"object_{i}: %json {json.dumps(_call_object(function))}")
        names += [f"bare_{i}", f"fenced_{i}"]
    start = f"start: {' | '.join(names)}"
    return "\n".join([start, f"open: {tags[0]}", f"end: {tags[1]}", *rules])


def _call_object(function: dict[str, Any]) -> dict[str, Any]:
    """The schema of a whole call object to `function`, spaced freely (a code block's)."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": function.get("parameters") or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _tag_terms(hf_tokenizer: Any) -> tuple[str, str]:
    """The call tags as the grammar must spell them: a tokenizer that has them as special
    tokens (Qwen2.5's) writes each as that one token, never as its text's pieces; others
    write the text."""
    added = hf_tokenizer.get_added_vocab() if hasattr(hf_tokenizer, "get_added_vocab") else {}
    return (
        f"<[{added[OPEN_TAG]}]>" if OPEN_TAG in added else json.dumps(OPEN_TAG),
        f"<[{added[CLOSE_TAG]}]>" if CLOSE_TAG in added else json.dumps(CLOSE_TAG),
    )


class CallGrammar:
    """Compiles call grammars for one tokenizer (built once: it takes ~0.3 s)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_token_ids))
        self.vocab_size = self._tokenizer.vocab_size
        self._tags = _tag_terms(hf_tokenizer)

    def mask(
        self,
        tools: Sequence[dict[str, Any]],
        prompt_tokens: int,
        *,
        forced: bool,
        call_threshold: float = 0.0,
    ) -> CallMask:
        """A processor for one request whose prompt is `prompt_tokens` long."""
        grammar = llguidance.LLMatcher.grammar_from_lark(_lark(tools, self._tags, forced=forced))
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"the tools' schemas cannot be enforced: {error}")
        return CallMask(
            self._tokenizer, grammar, prompt_tokens, forced=forced, call_threshold=call_threshold
        )


class CallMask:
    """The logits processor of one request (mlx-lm's `fn(tokens, logits)` convention).

    It is a function of the tokens it is given: a history shorter than what it has
    consumed (a draw dropped by a preemption) rolls its matcher back first.
    """

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        grammar: str,
        prompt_tokens: int,
        *,
        forced: bool,
        call_threshold: float = 0.0,
    ) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._prompt_tokens = prompt_tokens
        self._call_threshold = call_threshold
        self._matcher = llguidance.LLMatcher(tokenizer, grammar) if forced else None
        self._consumed = 0  # output tokens fed to the matcher
        self._free = False  # auto: the reply is plain text, nothing to enforce
        self._bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._free:
            return logits
        output = cast("list[int]", tokens[self._prompt_tokens :].tolist())
        if self._matcher is None and not self._engage(output, logits):
            return logits
        assert self._matcher is not None
        self._follow(output)
        return mx.where(self._allowed(self._matcher, logits), logits, -mx.inf)

    def _allowed(self, matcher: llguidance.LLMatcher, logits: mx.array) -> mx.array:
        """The tokens `matcher` admits next, as a row mask over `logits`."""
        fill_next_token_bitmask(matcher, self._bitmask, 0)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return mx.array(allowed[: logits.shape[-1]].astype(bool))[None, :]

    def _engage(self, output: list[int], logits: mx.array) -> bool:
        """Auto mode: whether the reply has become a call (then the grammar holds): it
        starts as one, or its first token's probability on starting one reaches
        `call_threshold`."""
        if not output and self._call_threshold > 0:
            matcher = llguidance.LLMatcher(self._tokenizer, self._grammar)
            probs = mx.softmax(logits.astype(mx.float32), axis=-1)
            share = cast(float, mx.sum(mx.where(self._allowed(matcher, logits), probs, 0.0)).item())
            if share >= self._call_threshold:
                self._matcher = matcher
                return True
        text = self._tokenizer.decode_str(output)
        if any(text.startswith(opening) for opening in _OPENINGS):
            self._matcher = llguidance.LLMatcher(self._tokenizer, self._grammar)
            return True
        if not any(opening.startswith(text) for opening in _OPENINGS):
            self._free = True
        return False

    def _follow(self, output: list[int]) -> None:
        """Bring the matcher to exactly `output`."""
        assert self._matcher is not None
        if len(output) < self._consumed:
            self._matcher.rollback(self._consumed - len(output))
            self._consumed = len(output)
        new = output[self._consumed :]
        if new and not self._matcher.consume_tokens(new):
            raise ValueError(f"the call left its grammar: {self._matcher.get_error()}")
        self._consumed = len(output)
