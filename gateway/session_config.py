"""The effective settings of one realtime session, and how updates change them.

Both protocol shapes update the same `SessionSettings`; `ga_object` and `beta_object`
render it back whole, as `session.created` / `session.updated` carry it. A setting the
gateway cannot honour raises `SettingError`, which the session turns into an `error`
event naming the parameter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from duplex.turn import Tool, ToolChoice
from gateway.audio import PCM16, AudioFormat, AudioFormatError, format_from_beta, format_from_ga
from gateway.config import GatewayConfig
from gateway.protocol import (
    BetaSessionIn,
    GASessionIn,
    TranscriptionIn,
    TurnDetectionIn,
)
from gateway.tools import (
    ToolSettingError,
    check_choice,
    parse_tool_choice,
    parse_tools,
    tool_choice_object,
    tool_objects,
)

__all__ = ["SessionSettings", "SettingError", "TurnDetection", "apply_update"]


class SettingError(ValueError):
    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# semantic_vad's eagerness -> the longest silence it waits before ending a turn the
# turn-end model scored incomplete (OpenAI's documented 8 s / 4 s / 2 s; auto = medium).
EAGERNESS_MAX_WAIT_MS = {"low": 8000, "medium": 4000, "high": 2000, "auto": 4000}
# server_vad's tuning fields, which semantic_vad does not take.
_SERVER_VAD_ONLY = ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms")


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

    def as_dict(self) -> dict[str, Any]:
        if self.semantic:
            return {
                "type": "semantic_vad",
                "eagerness": self.eagerness,
                "create_response": self.create_response,
                "interrupt_response": self.interrupt_response,
            }
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "idle_timeout_ms": self.idle_timeout_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }


@dataclass(frozen=True)
class LiveTranscription:
    """How the resident speech-to-text transcribes speech while it is spoken: `prompt`
    is text the speech follows, `logprobs` asks for each token's log probability."""

    prompt: str = ""
    logprobs: bool = False


@dataclass(frozen=True)
class SessionSettings:
    id: str
    model: str
    voice: str
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    speed: float = 1.0
    input_format: AudioFormat = PCM16
    output_format: AudioFormat = PCM16
    transcription: dict[str, Any] | None = None
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    max_output_tokens: int | None = None
    truncation: str = "auto"
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    expires_at: int = field(default_factory=lambda: int(time.time()) + 3600)

    def live_transcription(self) -> LiveTranscription | None:
        """What the resident speech-to-text is asked for while the user speaks; None when
        the session asks for no transcription."""
        if self.transcription is None:
            return None
        return LiveTranscription(prompt=self.transcription.get("prompt") or "")

    def ga_object(self) -> dict[str, Any]:
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "tools": tool_objects(self.tools),
            "tool_choice": tool_choice_object(self.tool_choice),
            "max_output_tokens": "inf"
            if self.max_output_tokens is None
            else self.max_output_tokens,
            "tracing": None,
            "prompt": None,
            "truncation": self.truncation,
            "expires_at": self.expires_at,
            "include": None,
            "audio": {
                "input": {
                    "format": self.input_format.ga_shape(),
                    "transcription": self.transcription,
                    "noise_reduction": None,
                    "turn_detection": self.turn_detection and self.turn_detection.as_dict(),
                },
                "output": {
                    "format": self.output_format.ga_shape(),
                    "voice": self.voice,
                    "speed": self.speed,
                },
            },
        }

    def beta_object(self) -> dict[str, Any]:
        return {
            "object": "realtime.session",
            "id": self.id,
            "model": self.model,
            "modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "voice": self.voice,
            "speed": self.speed,
            "input_audio_format": self.input_format.beta_name,
            "output_audio_format": self.output_format.beta_name,
            "input_audio_transcription": self.transcription,
            "input_audio_noise_reduction": None,
            "turn_detection": self.turn_detection and self.turn_detection.as_dict(),
            "tools": tool_objects(self.tools),
            "tool_choice": tool_choice_object(self.tool_choice),
            "max_response_output_tokens": "inf"
            if self.max_output_tokens is None
            else self.max_output_tokens,
            "expires_at": self.expires_at,
        }


def apply_update(
    current: SessionSettings,
    raw: dict[str, Any],
    *,
    beta: bool,
    config: GatewayConfig,
    voice_locked: bool,
) -> SessionSettings:
    """The settings after a `session.update`; raises SettingError, leaving `current` as is."""
    update: GASessionIn | BetaSessionIn
    if beta:
        update = BetaSessionIn.model_validate(raw)
        changes = _beta_changes(update, current)
    else:
        update = GASessionIn.model_validate(raw)
        changes = _ga_changes(update, current)
    changes.update(_shared_changes(update, current, config))
    new = replace(current, **changes)
    _check_supported(new, current, config, voice_locked)
    if new.turn_detection and new.turn_detection.semantic and not config.semantic_vad:
        where = "session.turn_detection" if beta else "session.audio.input.turn_detection"
        raise SettingError(
            "semantic_vad needs the turn-end model, which this server has not loaded "
            "(profile stages.turn.model); use server_vad or null",
            f"{where}.type",
        )
    return new


def _shared_changes(
    update: GASessionIn | BetaSessionIn, current: SessionSettings, config: GatewayConfig
) -> dict[str, Any]:
    given = update.model_fields_set
    changes: dict[str, Any] = {}
    if "model" in given and update.model not in (None, current.model):
        # Another name this profile answers to is only a new name for the same models.
        if not config.serves(update.model):
            raise SettingError(
                f"the model {update.model!r} is not served here; the session model is "
                f"{current.model!r}",
                "session.model",
            )
        changes["model"] = update.model
    if "instructions" in given:
        changes["instructions"] = update.instructions or ""
    changes.update(_tool_changes(update, current))
    if update.tracing is not None:
        raise SettingError("tracing is not supported", "session.tracing")
    if update.include:
        raise SettingError("include is not supported", "session.include")
    return changes


def _tool_changes(update: GASessionIn | BetaSessionIn, current: SessionSettings) -> dict[str, Any]:
    given = update.model_fields_set
    try:
        tools = parse_tools(update.tools, "session.tools") if "tools" in given else current.tools
        choice = current.tool_choice
        if "tool_choice" in given and update.tool_choice is not None:
            choice = parse_tool_choice(update.tool_choice, "session.tool_choice")
        check_choice(tools, choice, "session.tool_choice")
    except ToolSettingError as exc:
        raise SettingError(str(exc), exc.param) from None
    return {"tools": tools, "tool_choice": choice}


def _ga_changes(update: GASessionIn, current: SessionSettings) -> dict[str, Any]:
    if update.type != "realtime":
        raise SettingError("only realtime sessions are supported (type 'realtime')", "session.type")
    given = update.model_fields_set
    changes: dict[str, Any] = {}
    if update.output_modalities is not None:
        changes["output_modalities"] = _modalities(update.output_modalities, ga=True)
    if "max_output_tokens" in given:
        changes["max_output_tokens"] = _max_tokens(update.max_output_tokens)
    if update.prompt is not None:
        raise SettingError("stored prompts are not supported", "session.prompt")
    if "truncation" in given and update.truncation is not None:
        if update.truncation not in ("auto", "disabled"):
            raise SettingError("truncation must be 'auto' or 'disabled'", "session.truncation")
        changes["truncation"] = update.truncation
    audio = update.audio
    if audio and audio.input:
        given_in = audio.input.model_fields_set
        if audio.input.format is not None:
            changes["input_format"] = _ga_format(
                audio.input.format.model_dump(exclude_none=True), "session.audio.input.format"
            )
        if "transcription" in given_in:
            changes["transcription"] = _transcription(audio.input.transcription)
        if audio.input.noise_reduction is not None:
            raise SettingError(
                "noise reduction is not supported", "session.audio.input.noise_reduction"
            )
        if "turn_detection" in given_in:
            changes["turn_detection"] = _turn_detection(
                audio.input.turn_detection,
                current.turn_detection,
                "session.audio.input.turn_detection",
            )
    if audio and audio.output:
        if audio.output.format is not None:
            changes["output_format"] = _ga_format(
                audio.output.format.model_dump(exclude_none=True), "session.audio.output.format"
            )
        if audio.output.voice is not None:
            changes["voice"] = audio.output.voice
        if audio.output.speed is not None:
            changes["speed"] = audio.output.speed
    return changes


def _beta_changes(update: BetaSessionIn, current: SessionSettings) -> dict[str, Any]:
    given = update.model_fields_set
    changes: dict[str, Any] = {}
    if update.modalities is not None:
        changes["output_modalities"] = _modalities(update.modalities, ga=False)
    if update.voice is not None:
        changes["voice"] = update.voice
    if update.speed is not None:
        changes["speed"] = update.speed
    if update.input_audio_format is not None:
        changes["input_format"] = _beta_format(update.input_audio_format, "input_audio_format")
    if update.output_audio_format is not None:
        changes["output_format"] = _beta_format(update.output_audio_format, "output_audio_format")
    if "input_audio_transcription" in given:
        changes["transcription"] = _transcription(update.input_audio_transcription)
    if update.input_audio_noise_reduction is not None:
        raise SettingError(
            "noise reduction is not supported", "session.input_audio_noise_reduction"
        )
    if "turn_detection" in given:
        changes["turn_detection"] = _turn_detection(
            update.turn_detection, current.turn_detection, "session.turn_detection"
        )
    if update.temperature is not None:
        raise SettingError(
            "temperature is not supported by the realtime API shape of this gateway",
            "session.temperature",
        )
    if "max_response_output_tokens" in given:
        changes["max_output_tokens"] = _max_tokens(update.max_response_output_tokens)
    return changes


def _modalities(values: Sequence[str], *, ga: bool) -> tuple[str, ...]:
    chosen = set(values)
    if chosen == {"text"}:
        return ("text",)
    if "audio" in chosen:
        # Beta's ["text", "audio"] means spoken output with its transcript.
        if ga and len(chosen) > 1:
            raise SettingError(
                "output_modalities is either ['audio'] or ['text']", "output_modalities"
            )
        return ("audio",)
    raise SettingError("output modalities must not be empty", "output_modalities")


def _max_tokens(value: int | str | None) -> int | None:
    # The event model (`gateway.values.TokenLimit`) checked the range; "inf" is the
    # model's own limit, which the engine applies when none is given.
    return value if isinstance(value, int) else None


def _ga_format(shape: dict[str, Any], param: str) -> AudioFormat:
    try:
        return format_from_ga(shape)
    except AudioFormatError as exc:
        raise SettingError(str(exc), param) from None


def _beta_format(name: str, param: str) -> AudioFormat:
    try:
        return format_from_beta(name)
    except AudioFormatError as exc:
        raise SettingError(str(exc), f"session.{param}") from None


def _transcription(value: TranscriptionIn | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if value.prompt:
        raise SettingError(
            "transcription prompts are not supported", "session.audio.input.transcription.prompt"
        )
    return {"model": value.model or "whisper-1", "language": value.language, "prompt": None}


def _turn_detection(
    value: TurnDetectionIn | None, current: TurnDetection | None, param: str
) -> TurnDetection | None:
    if value is None:
        return None
    # Fields left out keep their current value: a partial update never drops the type.
    # A new type starts from that type's defaults.
    kind = value.type or (current.type if current else "server_vad")
    base = current if current is not None and current.type == kind else TurnDetection(type=kind)
    given = {
        k: v
        for k, v in value.model_dump(exclude={"type"}).items()
        if k in value.model_fields_set and (v is not None or k == "idle_timeout_ms")
    }
    if kind == "semantic_vad":
        for name in _SERVER_VAD_ONLY:
            if name in given:
                raise SettingError(
                    f"{name} applies only to server_vad; semantic_vad takes eagerness, "
                    "create_response and interrupt_response",
                    f"{param}.{name}",
                )
    elif "eagerness" in given:
        raise SettingError("eagerness applies only to semantic_vad", f"{param}.eagerness")
    return replace(base, **given)


def _check_supported(
    new: SessionSettings, current: SessionSettings, config: GatewayConfig, voice_locked: bool
) -> None:
    if new.voice != current.voice:
        if voice_locked:
            raise SettingError(
                "voice cannot be changed after the assistant has spoken",
                "session.voice",
            )
        if new.voice not in config.voices:
            raise SettingError(
                f"unknown voice {new.voice!r}; supported: {', '.join(config.voices)}",
                "session.voice",
            )
    language = (new.transcription or {}).get("language")
    if language and language not in config.transcription_languages:
        raise SettingError(
            f"transcription language {language!r} is not supported; supported: "
            f"{', '.join(config.transcription_languages)}",
            "session.audio.input.transcription.language",
        )
