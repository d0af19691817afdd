"""The effective settings of one realtime session: `SessionSettings` and the values it
holds.

Both protocol shapes update the same `SessionSettings` (`gateway.protocol.session_update` reads
a `session.update`); `gateway.protocol.session_object` renders it back whole, as
`session.created` / `session.updated` carry it. A setting the gateway cannot honour
raises `SettingError`, which the session turns into an `error` event naming the
parameter.

A session is of one of two types, fixed when it connects: "realtime" (a conversation)
or "transcription" (`?intent=transcription`: input audio is committed and transcribed,
and nothing ever answers it). An update of the other type is refused, as the service
refuses it. A transcription session takes only input settings; its turn detection never
creates or interrupts responses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from duplex.turn import Tool, ToolChoice
from gateway.protocol.audio import PCM16, AudioFormat
from gateway.protocol.events import ReasoningIn, RetentionRatioIn, TracingIn
from gateway.protocol.prompts import StoredPrompt
from gateway.session.input_processing import NoiseReduction

__all__ = [
    "DEFAULT_TRANSCRIPTION",
    "LOGPROBS",
    "TRANSCRIPTION_MODELS",
    "LiveTranscription",
    "SessionSettings",
    "SettingError",
    "TurnDetection",
    "transcription_session",
]


class SettingError(ValueError):
    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# semantic_vad's eagerness -> the longest silence it waits before ending a turn the
# turn-end model scored incomplete (OpenAI's documented 8 s / 4 s / 2 s; auto = medium).
EAGERNESS_MAX_WAIT_MS = {"low": 8000, "medium": 4000, "high": 2000, "auto": 4000}

# The transcription model names OpenAI documents. Whichever is asked for, the profile's
# speech-to-text (stages.asr.model, Whisper) transcribes; the session reports the name
# it was given. Diarization (speaker labels) is not something Whisper does.
TRANSCRIPTION_MODELS = (
    "whisper-1",
    "gpt-4o-transcribe",
    "gpt-4o-mini-transcribe",
    "gpt-4o-mini-transcribe-2025-12-15",
    "gpt-transcribe",
    "gpt-live-transcribe",
    "gpt-realtime-whisper",
)
DEFAULT_TRANSCRIPTION = {"model": "whisper-1", "language": None, "prompt": None}
# The one value `include` takes: each transcript token's log probability.
LOGPROBS = "item.input_audio_transcription.logprobs"


@dataclass(frozen=True)
class TurnDetection:
    """`type` "server_vad" ends a turn after `silence_duration_ms` of silence;
    "semantic_vad" asks the turn-end model when a silence begins (see
    `gateway.turn_detection`) and waits at most `max_wait_ms` for its `eagerness`."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    type: str = "server_vad"
    eagerness: str = "auto"

    @property
    def semantic(self) -> bool:
        return self.type == "semantic_vad"

    @property
    def max_wait_ms(self) -> int:
        return EAGERNESS_MAX_WAIT_MS[self.eagerness]


@dataclass(frozen=True)
class LiveTranscription:
    """How the resident speech-to-text transcribes speech while it is spoken: `prompt`
    is text the speech follows, `logprobs` asks for each token's log probability."""

    prompt: str = ""
    logprobs: bool = False


@dataclass(frozen=True)
class SessionSettings:
    """`type` is "realtime" or "transcription" (see the module's docstring); `include`
    holds the `include` values asked for (only `LOGPROBS`)."""

    id: str
    model: str
    voice: str
    type: str = "realtime"
    include: tuple[str, ...] = ()
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    speed: float = 1.0
    input_format: AudioFormat = PCM16
    output_format: AudioFormat = PCM16
    transcription: dict[str, Any] | None = None
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    max_output_tokens: int | None = None
    truncation: str | RetentionRatioIn = "auto"
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    # Input processing (gateway.session.input_processing): OpenAI's noise reduction (None: off),
    # and this gateway's echo canceller, which works while output audio plays.
    noise_reduction: NoiseReduction | None = None
    echo_cancellation: bool = True
    expires_at: int = field(default_factory=lambda: int(time.time()) + 3600)
    # The LLM's sampling temperature (beta); None: the profile's.
    temperature: float | None = None
    # False: at most one function call per response (the local model never makes more).
    parallel_tool_calls: bool | None = None
    prompt: StoredPrompt | None = None
    # Accepted and reported; the LLM does not reason, so every effort answers alike.
    reasoning: ReasoningIn | None = None
    # Where the trace goes: the gateway's log, a line per response (gateway.server.connection).
    tracing: Literal["auto"] | TracingIn | None = None

    @property
    def truncates(self) -> bool:
        """Whether the oldest history is dropped when the context is over its limit."""
        return self.truncation != "disabled"

    @property
    def retention_ratio(self) -> float | None:
        """With retention-ratio truncation: the share of the limit kept when cutting."""
        truncation = self.truncation
        return truncation.retention_ratio if isinstance(truncation, RetentionRatioIn) else None

    @property
    def post_instructions_tokens(self) -> int | None:
        """With retention-ratio truncation: its own limit on the tokens after the
        instructions, if it sets one."""
        if not isinstance(self.truncation, RetentionRatioIn) or not self.truncation.token_limits:
            return None
        return self.truncation.token_limits.post_instructions

    @property
    def transcription_only(self) -> bool:
        """A transcription session: it never creates responses."""
        return self.type == "transcription"

    @property
    def include_logprobs(self) -> bool:
        """Transcription events carry each token's log probability (`include`)."""
        return LOGPROBS in self.include

    def live_transcription(self) -> LiveTranscription | None:
        """What the resident speech-to-text is asked for while the user speaks; None when
        the session asks for no transcription."""
        if self.transcription is None:
            return None
        return LiveTranscription(
            prompt=self.transcription.get("prompt") or "", logprobs=self.include_logprobs
        )


def transcription_session(settings: SessionSettings) -> SessionSettings:
    """`settings` made a new transcription session's: transcription on (Whisper under
    the default name), server VAD that commits speech and never responds."""
    return replace(
        settings,
        type="transcription",
        transcription=dict(DEFAULT_TRANSCRIPTION),
        turn_detection=TurnDetection(create_response=False, interrupt_response=False),
        tools=(),
        tool_choice=ToolChoice(),
    )
