"""The turn request: the one value the gateway hands the speech pipeline for a turn.

It travels inside `DuplexAppendPlan.prompt` under the key `"turn"` (the seed's prompt is
a mapping), and the stage port reads it back typed with `TurnRequest.from_plan`.

Rules of this module:

1. A `TurnRequest` is validated when it is built, so an invalid one cannot exist; the
   port does not check it again.
2. The stages a turn runs through follow from its fields: audio enters at `Stage.ASR`,
   text (or nothing new: a reply to the history alone) at `Stage.LLM`; `final` says
   where it ends (a transcript, a text reply, or a spoken reply). No stage number is
   written anywhere else.
3. Equal requests are equal values (`==`): a prepared turn is adopted by the submission
   whose request equals it.
4. Tools are plain values too: a function's JSON Schema travels as JSON text (checked to
   be an object when the `Tool` is built), so a request stays hashable and comparable.
   `tool_choice` says whether the reply may (`auto`), may not (`none`) or must
   (`required`, or `function` with a `name`) be a call of one of `tools`.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from duplex.contracts import DuplexAppendPlan

__all__ = ["AUDIO_RATE", "Message", "Stage", "Tool", "ToolCall", "ToolChoice", "TurnRequest"]

# Turn audio: mono float32 little-endian samples at this rate.
AUDIO_RATE = 16_000
MIN_SPEED, MAX_SPEED = 0.25, 4.0
_ROLES = ("system", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICE_MODES = ("auto", "none", "required", "function")


class Stage(enum.IntEnum):
    """The pipeline's stages; the value is the stage id of its requests."""

    ASR = 0  # speech to text
    LLM = 1  # the reply's text
    TTS = 2  # the reply's speech


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: `parameters` is its JSON Schema as JSON text."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _TOOL_NAME.fullmatch(self.name):
            raise ValueError(f"a tool name is 1 to 64 of [A-Za-z0-9_-], got {self.name!r}")
        if not isinstance(self.description, str):
            raise ValueError("a tool description must be a str")
        try:
            schema = json.loads(self.parameters)
        except (TypeError, ValueError):
            raise ValueError(f"tool {self.name!r}: parameters must be JSON text") from None
        if not isinstance(schema, dict):
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON Schema object")

    @property
    def schema(self) -> dict[str, object]:
        parsed: dict[str, object] = json.loads(self.parameters)
        return parsed


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the assistant made: `arguments` is the JSON text of the arguments object."""

    call_id: str
    name: str
    arguments: str

    def __post_init__(self) -> None:
        for name in ("call_id", "name", "arguments"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"ToolCall.{name} must be a str")
        if not self.call_id:
            raise ValueError("ToolCall.call_id must not be empty")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`auto`, `none`, `required`, or `function` (with the function's `name`)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in _CHOICE_MODES:
            raise ValueError(f"ToolChoice.mode must be one of {_CHOICE_MODES}, got {self.mode!r}")
        if (self.mode == "function") != (self.name is not None):
            raise ValueError("ToolChoice takes a name exactly when its mode is 'function'")

    @property
    def must_call(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message. An assistant message may carry the calls it made
    (`tool_calls`); a `tool` message is the result of the call `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        if self.role not in _ROLES:
            raise ValueError(f"Message.role must be one of {_ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise ValueError(f"Message.content must be a str, got {type(self.content).__name__}")
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if not all(isinstance(c, ToolCall) for c in self.tool_calls):
            raise ValueError("Message.tool_calls must hold ToolCall values")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, names its tool_call_id")


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRequest:
    """One turn: what to answer (`audio` or `text`, or neither), the history before it,
    and how far the pipeline goes (`final`).

    `messages` is the history before this turn; a leading system message replaces the
    configured system prompt. `voice` and `speed` apply to spoken replies only,
    `max_output_tokens`, `cache_key` (the conversation's prompt-cache key) and `truncate`
    (drop the oldest history when the prompt is over the engine's context limit, rather
    than refuse the turn) to replies; with `retention_ratio`, a prompt over its limit (the
    engine's, or `post_instructions_tokens` after the system message) drops the oldest
    history until that share of the limit is used. `temperature` replaces the LLM's
    sampling temperature. `tools` and `tool_choice` say which functions the reply may
    call (rule 4); `parallel_tool_calls` False allows at most one call.
    A transcription turn (`final=Stage.ASR`) takes `audio` alone.

    Speech-to-text options, for a turn with `audio`: `utterance` names the audio the
    session's resident speech-to-text has been transcribing live (the item id); its live
    transcript is finished rather than started over, and the final transcript begins
    with every word already reported live; where the session's speech detection already
    heard its words, they are reported rather than the same speech transcribed again.
    `transcription_prompt` is text the speech follows (Whisper reads it as the previous
    context); `logprobs` asks for each transcript token's log probability.
    """

    final: Stage
    audio: bytes | None = None  # float32 LE mono at AUDIO_RATE
    text: str | None = None
    messages: tuple[Message, ...] = ()
    max_output_tokens: int | None = None
    voice: str | None = None
    speed: float | None = None
    cache_key: str | None = None
    truncate: bool = True
    retention_ratio: float | None = None
    post_instructions_tokens: int | None = None
    temperature: float | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool | None = None
    utterance: str | None = None
    transcription_prompt: str = ""
    logprobs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "final", Stage(self.final))
        object.__setattr__(self, "messages", tuple(self.messages))
        object.__setattr__(self, "tools", tuple(self.tools))
        self._check_input()
        self._check_reply()
        self._check_tools()

    def _check_tools(self) -> None:
        if not all(isinstance(t, Tool) for t in self.tools):
            raise ValueError("TurnRequest.tools must hold Tool values")
        if not isinstance(self.tool_choice, ToolChoice):
            raise ValueError("TurnRequest.tool_choice must be a ToolChoice")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if self.tools and self.final is Stage.ASR:
            raise ValueError("a transcription turn takes no tools")
        choice = self.tool_choice
        if choice.must_call and not self.tools:
            raise ValueError(f"tool_choice {choice.mode!r} needs tools")
        if choice.name is not None and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")

    def _check_input(self) -> None:
        if self.audio is not None and self.text is not None:
            raise ValueError("a turn takes at most one of audio or text")
        if self.audio is not None and (
            not isinstance(self.audio, bytes) or not self.audio or len(self.audio) % 4
        ):
            raise ValueError("turn audio must be non-empty float32 samples (bytes)")
        if self.text is not None and not isinstance(self.text, str):
            raise ValueError("turn text must be a str")
        for i, message in enumerate(self.messages):
            if not isinstance(message, Message):
                raise ValueError(f"messages[{i}] must be a Message, got {message!r}")

    def _check_reply(self) -> None:
        if self.final < self.entry:
            raise ValueError(f"a {self.entry.name} turn cannot end at {self.final.name}")
        if self.final is Stage.ASR:
            reply_fields = (self.messages, self.max_output_tokens, self.voice, self.speed)
            llm_fields = (
                self.retention_ratio,
                self.post_instructions_tokens,
                self.temperature,
                self.parallel_tool_calls,
            )
            if any(reply_fields) or self.cache_key is not None or not self.truncate:
                raise ValueError("a transcription turn takes audio alone")
            if any(value is not None for value in llm_fields):
                raise ValueError("a transcription turn takes audio alone")
        self._check_sampling()
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate must be a bool, got {self.truncate!r}")
        tokens = self.max_output_tokens
        if tokens is not None and (type(tokens) is not int or tokens < 1):
            raise ValueError(f"max_output_tokens must be a positive int, got {tokens!r}")
        if self.final is not Stage.TTS and (self.voice is not None or self.speed is not None):
            raise ValueError("voice and speed apply to spoken replies only")
        speed = self.speed
        if speed is not None and not (
            isinstance(speed, (int, float))
            and math.isfinite(speed)
            and MIN_SPEED <= speed <= MAX_SPEED
        ):
            raise ValueError(f"speed must be a number in [{MIN_SPEED}, {MAX_SPEED}], got {speed!r}")

    def _check_sampling(self) -> None:
        ratio, temperature = self.retention_ratio, self.temperature
        if ratio is not None and not (_is_number(ratio) and 0.0 <= ratio <= 1.0):
            raise ValueError(f"retention_ratio must be a number in [0, 1], got {ratio!r}")
        if ratio is not None and not self.truncate:
            raise ValueError("retention_ratio goes with truncate")
        limit = self.post_instructions_tokens
        if limit is not None and (type(limit) is not int or limit < 1 or ratio is None):
            raise ValueError(
                f"post_instructions_tokens must be a positive int with a retention_ratio, "
                f"got {limit!r}"
            )
        if temperature is not None and not (_is_number(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        parallel = self.parallel_tool_calls
        if parallel is not None and not isinstance(parallel, bool):
            raise ValueError(f"parallel_tool_calls must be a bool, got {parallel!r}")

    @property
    def entry(self) -> Stage:
        return Stage.ASR if self.audio is not None else Stage.LLM

    @property
    def audio_seconds(self) -> float:
        return 0.0 if self.audio is None else len(self.audio) / 4 / AUDIO_RATE

    def plan(self) -> DuplexAppendPlan:
        return DuplexAppendPlan(prompt={"turn": self})

    @staticmethod
    def from_plan(prompt: Mapping[str, object]) -> TurnRequest:
        """The request inside a `DuplexAppendPlan.prompt`; ValueError if there is none."""
        turn = prompt.get("turn")
        if not isinstance(turn, TurnRequest) or len(prompt) != 1:
            raise ValueError("a turn prompt holds one TurnRequest under 'turn'")
        return turn


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
