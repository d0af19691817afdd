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
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from duplex.contracts import DuplexAppendPlan

__all__ = ["AUDIO_RATE", "Message", "Stage", "TurnRequest"]

# Turn audio: mono float32 little-endian samples at this rate.
AUDIO_RATE = 16_000
MIN_SPEED, MAX_SPEED = 0.25, 4.0
_ROLES = ("system", "user", "assistant")


class Stage(enum.IntEnum):
    """The pipeline's stages; the value is the stage id of its requests."""

    ASR = 0  # speech to text
    LLM = 1  # the reply's text
    TTS = 2  # the reply's speech


@dataclass(frozen=True, slots=True)
class Message:
    role: Literal["system", "user", "assistant"]
    content: str

    def __post_init__(self) -> None:
        if self.role not in _ROLES:
            raise ValueError(f"Message.role must be one of {_ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise ValueError(f"Message.content must be a str, got {type(self.content).__name__}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRequest:
    """One turn: what to answer (`audio` or `text`, or neither), the history before it,
    and how far the pipeline goes (`final`).

    `messages` is the history before this turn; a leading system message replaces the
    configured system prompt. `voice` and `speed` apply to spoken replies only,
    `max_output_tokens`, `cache_key` (the conversation's prompt-cache key) and `truncate`
    (drop the oldest history when the prompt is over the engine's context limit, rather
    than refuse the turn) to replies.
    A transcription turn (`final=Stage.ASR`) takes `audio` alone.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "final", Stage(self.final))
        object.__setattr__(self, "messages", tuple(self.messages))
        self._check_input()
        self._check_reply()

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
            if any(reply_fields) or self.cache_key is not None or not self.truncate:
                raise ValueError("a transcription turn takes audio alone")
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
