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
- `Detect(...)`, prompt `{"append": "detect", ...}` with one key per field: detect
  speech from now on with these settings (server VAD, semantic turn ends, interruption
  checks), or (`enabled=False`) not at all. Its decisions come back as `"speech"`
  outputs of the resident request (`duplex.events.SpeechDecision`). `start_ms` is the
  session time the detection starts at, `clock` the session clock then, as for `Listen`;
- `WatchWords(again)`, prompt `{"append": "watch_words", "again": bool}`: the speech
  under way started over a running answer; check its words, and confirm it early if
  they are more than a backchannel. `again`: its confirmation did not count (the answer's
  own echo): confirm it afresh from now.

`plan()` builds the `DuplexAppendPlan` of a value and `read_append` reads one back,
refusing a malformed prompt with ValueError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from duplex.contracts import DuplexAppendPlan

__all__ = [
    "Append",
    "Detect",
    "Heard",
    "Listen",
    "UtteranceEnded",
    "UtteranceStarted",
    "WatchWords",
    "read_append",
]

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


@dataclass(frozen=True, slots=True)
class Detect:
    """How the session's speech is detected from now on (see the module table). The
    session's settings first, then the server's turn-taking thresholds, which the
    gateway's profile holds (`docs/protocol.md`, "Turn detection")."""

    enabled: bool = True
    start_ms: float = 0.0
    clock: int = 0
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_ms: int = 500  # the silence that ends speech; semantic: the longest wait
    semantic: bool = False
    pause_after_ms: int | None = None  # silences this long are reported as pauses
    unsure_wait_ms: int = 0  # semantic: the silence an ending Whisper doubts needs
    score_after_ms: int = 160
    rescore_ms: int | None = 400
    complete_threshold: float = 0.5
    words: bool = True
    words_after_ms: int = 64
    interruption_words_after_ms: int | None = None
    interruption_words_every_ms: int | None = None  # None: as interruption_words_after_ms
    min_interruption_ms: int = 0

    def plan(self) -> DuplexAppendPlan:
        return DuplexAppendPlan({"append": "detect", **asdict(self)})


@dataclass(frozen=True, slots=True)
class WatchWords:
    again: bool = False

    def plan(self) -> DuplexAppendPlan:
        return DuplexAppendPlan({"append": "watch_words", "again": self.again})


Append = Heard | UtteranceStarted | UtteranceEnded | Listen | Detect | WatchWords


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
    if kind == "detect":
        return _read_detect(prompt)
    if kind == "watch_words":
        again = prompt.get("again")
        if not isinstance(again, bool):
            raise ValueError("watch_words needs a bool again")
        return WatchWords(again)
    raise ValueError(f"not a resident stage-0 append: {kind!r}")


def _utterance_id(prompt: Mapping[str, object]) -> str:
    utterance_id = prompt.get("utterance_id")
    if not isinstance(utterance_id, str) or not utterance_id:
        raise ValueError("an utterance append needs a non-empty utterance_id")
    return utterance_id


# What each of `Detect`'s fields may hold: its types, and whether None is allowed.
_DETECT_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    "enabled": ((bool,), False),
    "start_ms": ((int, float), False),
    "threshold": ((int, float), False),
    "semantic": ((bool,), False),
    "complete_threshold": ((int, float), False),
    "words": ((bool,), False),
    "pause_after_ms": ((int,), True),
    "rescore_ms": ((int,), True),
    "interruption_words_after_ms": ((int,), True),
    "interruption_words_every_ms": ((int,), True),
}


def _read_detect(prompt: Mapping[str, object]) -> Detect:
    values: dict[str, object] = {}
    for field in fields(Detect):
        value = prompt.get(field.name)
        types, optional = _DETECT_TYPES.get(field.name, ((int,), False))
        if value is None and optional:
            values[field.name] = None
            continue
        number = types != (bool,)
        if not isinstance(value, types) or (number and isinstance(value, bool)):
            raise ValueError(f"detect needs {field.name} as {'/'.join(t.__name__ for t in types)}")
        if number and value < 0:  # type: ignore[operator]
            raise ValueError(f"detect needs {field.name} >= 0")
        values[field.name] = float(value) if float in types else value  # type: ignore[arg-type]
    return Detect(**values)  # type: ignore[arg-type]
