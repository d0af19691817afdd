"""How the local model sees tools and writes calls, and how its text is read back.

SmolLM2's chat template has no tool format, so the local model uses the one its larger
sibling's card documents (the Hermes convention, also Qwen2.5's):

- the system message lists the functions, one JSON object per line, inside
  `<tools></tools>`, and says how to call one;
- a call is the reply `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`,
  at the very start of the reply, one call per reply. Qwen2.5-Coder, shown the tools by
  its own template, often writes the object alone (`{"name": NAME, "arguments": ARGS}`)
  or in a JSON code block, spaced freely: a reply that starts so is a call too (a code
  block's is read once the reply ends);
- an earlier call in the history is an assistant message holding that text, and its
  result a user message `<tool_response>\\n...\\n</tool_response>` followed by a short
  request to answer with it.

`CallReader` turns the reply's streamed text into plain text and call deltas. The call's
exact spelling (no free whitespace, `", "` and `": "` separators) is what the grammar in
`engine.llm.grammar` lets the model write, so reading it needs no JSON parser.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.runtime.request import ToolCallDelta

__all__ = [
    "BARE_OPEN",
    "CALL_OPEN",
    "FENCE_OPEN",
    "CallReader",
    "call_prefix",
    "call_text",
    "native_messages",
    "renders_tools",
    "template_messages",
    "tools_prompt",
]

CALL_OPEN = "<tool_call>\n"
BARE_OPEN = '{"name": "'  # a call object's start, also a call without the tags
FENCE_OPEN = "```json\n"  # a call object in a JSON code block, spaced freely
CALL_CLOSE = "\n</tool_call>"
_NAME_OPEN = BARE_OPEN
_ARGS_OPEN = '", "arguments": '
_SUFFIX = "}" + CALL_CLOSE  # closes the call object, then the block
# Without this nudge the embedded 135M model mostly ignored the result (tried by hand).
_USE_RESULT = "Answer with this result."


def call_prefix(name: str) -> str:
    """The text of a call to `name` up to its arguments."""
    return CALL_OPEN + _NAME_OPEN + name + _ARGS_OPEN


def call_text(name: str, arguments: str) -> str:
    return call_prefix(name) + arguments + _SUFFIX


def tools_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system-prompt text presenting `tools` (chat-completions `function` tools)."""
    lines = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    return (
        "You may call functions to answer. The functions you can call:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one, reply with nothing but\n"
        f'{CALL_OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CALL_CLOSE}\n'
        "Otherwise answer in plain words."
    )


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template presents tools itself (`tools=`), with the
    call format `CallReader` reads (Qwen2.5's does; SmolLM2's has no tools)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template and CALL_OPEN.strip() in template


def native_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat-completions messages for a template that renders tools itself: each call's
    arguments as the object such a template writes out as JSON."""
    out = []
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": _object(c["function"])}}
                for c in message["tool_calls"]
            ]
            message = {**message, "content": message.get("content") or "", "tool_calls": calls}
        out.append(dict(message))
    return out


def _object(function: dict[str, Any]) -> Any:
    try:
        return json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return function.get("arguments")


def template_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, str]]:
    """Chat-completions messages (with `tool_calls` and `tool` results) as the plain
    role/content messages SmolLM2's template renders, the tools in the system message."""
    out: list[dict[str, str]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [c["function"] for c in message["tool_calls"]]
            content = content + "".join(call_text(c["name"], c["arguments"]) for c in calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>\n{_USE_RESULT}"
        out.append({"role": role, "content": content})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": tools_prompt(tools)})
    return out


def _fenced_call(text: str) -> ToolCallDelta | None:
    """The call a fenced JSON block holds (`{"name": ..., "arguments": {...}}`), if any."""
    body = text.removeprefix(FENCE_OPEN).rstrip().removesuffix("```")
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return ToolCallDelta(
        index=0, name=value["name"], arguments=json.dumps(value.get("arguments", {}))
    )


@dataclass
class _Call:
    name: str | None = None
    shown: int = 0  # how much of the arguments text went out
    announced: bool = False


class CallReader:
    """Splits a reply's streamed text into plain text and the deltas of one call.

    Undecided while the reply so far could still become `<tool_call>` or a bare call
    object; a reply that starts with either is a call, any other is plain text. Text is
    held back only while undecided, and a call's arguments only for the few characters
    that may be its end.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._mode = "undecided"  # then "text", "call" or "fenced"
        self._call = _Call()
        self._open = CALL_OPEN  # or "" for a bare call object
        self.called = False

    def push(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += delta
        if self._mode == "undecided":
            starts = (CALL_OPEN + _NAME_OPEN, _NAME_OPEN, FENCE_OPEN)
            opened = [s for s in starts if self._buffer.startswith(s)]
            if opened == [FENCE_OPEN]:
                self._mode, self.called = "fenced", True
            elif opened:
                self._mode, self.called = "call", True
                self._open = CALL_OPEN if opened[0] != _NAME_OPEN else ""
            elif any(s.startswith(self._buffer) for s in starts):
                return "", []
            else:
                self._mode = "text"
        if self._mode == "text":
            text, self._buffer = self._buffer, ""
            return text, []
        if self._mode == "fenced":
            return "", []  # read whole once it ends: its spacing is free
        return "", self._call_deltas(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What was held back, once the reply ended."""
        if self._mode == "call":
            return "", self._call_deltas(final=True)
        if self._mode == "fenced":
            call = _fenced_call(self._buffer)
            if call is not None:
                return "", [call]
            self.called = False  # not a call object after all: the reply is text
        text, self._buffer = self._buffer, ""
        return text, []

    def _call_deltas(self, *, final: bool) -> list[ToolCallDelta]:
        body = self._buffer[len(self._open) :]
        suffix = _SUFFIX if self._open else "}"  # a bare object ends with its own brace
        call = self._call
        if call.name is None:
            if not body.startswith(_NAME_OPEN) or _ARGS_OPEN not in body:
                return []
            call.name = body[len(_NAME_OPEN) : body.index(_ARGS_OPEN)]
        args = body[len(_NAME_OPEN) + len(call.name) + len(_ARGS_OPEN) :]
        end = len(args) - len(suffix)
        if final and args.rstrip().endswith(suffix):
            end = len(args.rstrip()) - len(suffix)
        elif final:
            end = len(args)  # cut off before its end (the token limit): all of it
        if end > call.shown:
            delta, call.shown = args[call.shown : end], end
        elif not call.announced:
            delta = ""  # the name is known: the call can be shown before its arguments
        else:
            return []
        call.announced = True
        return [ToolCallDelta(index=0, name=call.name, arguments=delta)]
