"""What a session appends to its resident stage-0 request, as typed values.

The resident request (`...e.{epoch}.r.stage0`, one per epoch, see `duplex.session`
rule 5) hears the session's input as it happens. Each append is one of:

- `Heard(audio)`, prompt `{"append": "heard", "audio": bytes}`: the session's next
  samples, float32 little-endian mono at 16 kHz; the session clock is the count of
  samples heard (`ms * 16`);
- `UtteranceStarted(utterance_id, start_ms)`, prompt `{"append": "utterance_started",
  "utterance_id": str, "start_ms": float}`: speech began at session time `start_ms`;
  transcribe it live as `utterance_id`;
- `UtteranceEnded(utterance_id)`, prompt `{"append": "utterance_ended",
  "utterance_id": str}`: no more live work for it (committed, or dropped);
- `Listen(enabled, prompt, logprobs, clock)`, prompt `{"append": "listen", "enabled":
  bool, "prompt": str, "logprobs": bool, "clock": int}`: transcribe live from now on
  with these options, or (`enabled=False`) not at all. `clock` is the session clock
  (samples) at that moment: a session that does not listen need not send what it
  hears, and the clock tells how much it did not send.

`plan()` builds the `DuplexAppendPlan` of a value and `read_append` reads one back,
refusing a malformed prompt with ValueError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from duplex.contracts import DuplexAppendPlan

__all__ = ["Append", "Heard", "Listen", "UtteranceEnded", "UtteranceStarted", "read_append"]

SAMPLE_RATE = 16_000
_SAMPLE_BYTES = 4


@dataclass(frozen=True, slots=True)
class Heard:
    audio: bytes  # float32 little-endian mono, 16 kHz

    def plan(self) -> DuplexAppendPlan:
        return DuplexAppendPlan({"append": "heard", "audio": self.audio})

    @property
    def samples(self) -> int:
        return len(self.audio) // _SAMPLE_BYTES


@dataclass(frozen=True, slots=True)
class UtteranceStarted:
    utterance_id: str
    start_ms: float

    def plan(self) -> DuplexAppendPlan:
        prompt = {
            "append": "utterance_started",
            "utterance_id": self.utterance_id,
            "start_ms": self.start_ms,
        }
        return DuplexAppendPlan(prompt)


@dataclass(frozen=True, slots=True)
class UtteranceEnded:
    utterance_id: str

    def plan(self) -> DuplexAppendPlan:
        return DuplexAppendPlan({"append": "utterance_ended", "utterance_id": self.utterance_id})


@dataclass(frozen=True, slots=True)
class Listen:
    enabled: bool = True
    prompt: str = ""
    logprobs: bool = False
    clock: int = 0

    def plan(self) -> DuplexAppendPlan:
        prompt = {
            "append": "listen",
            "enabled": self.enabled,
            "prompt": self.prompt,
            "logprobs": self.logprobs,
            "clock": self.clock,
        }
        return DuplexAppendPlan(prompt)


Append = Heard | UtteranceStarted | UtteranceEnded | Listen


def read_append(prompt: Mapping[str, object]) -> Append:
    """The append a resident request's prompt holds.

    Raises:
        ValueError: the prompt is not one of the module table's shapes.
    """
    kind = prompt.get("append")
    if kind == "heard":
        audio = prompt.get("audio")
        if not isinstance(audio, bytes) or len(audio) % _SAMPLE_BYTES:
            raise ValueError("a heard append needs whole float32 samples as bytes")
        return Heard(audio)
    if kind == "utterance_started":
        start = prompt.get("start_ms")
        if not isinstance(start, (int, float)) or isinstance(start, bool) or start < 0:
            raise ValueError("utterance_started needs a start_ms >= 0")
        return UtteranceStarted(_utterance_id(prompt), float(start))
    if kind == "utterance_ended":
        return UtteranceEnded(_utterance_id(prompt))
    if kind == "listen":
        enabled, text, logprobs = (prompt.get(k) for k in ("enabled", "prompt", "logprobs"))
        if not isinstance(enabled, bool) or not isinstance(text, str):
            raise ValueError("listen needs a bool enabled and a str prompt")
        if not isinstance(logprobs, bool):
            raise ValueError("listen needs a bool logprobs")
        clock = prompt.get("clock")
        if not isinstance(clock, int) or isinstance(clock, bool) or clock < 0:
            raise ValueError("listen needs an int clock >= 0")
        return Listen(enabled, text, logprobs, clock)
    raise ValueError(f"not a resident stage-0 append: {kind!r}")


def _utterance_id(prompt: Mapping[str, object]) -> str:
    utterance_id = prompt.get("utterance_id")
    if not isinstance(utterance_id, str) or not utterance_id:
        raise ValueError("an utterance append needs a non-empty utterance_id")
    return utterance_id
