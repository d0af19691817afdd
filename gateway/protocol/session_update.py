"""How a `session.update` changes a session's settings, in the GA and the beta shape.

`apply_update` reads the update whole and returns the new settings, or raises
`SettingError` naming the parameter it cannot honour; the settings it started from are
left as they were. A transcription session's update (a GA `session.update` of type
"transcription", or beta's `transcription_session.update`) takes only input settings and
`include`. The readers of single values (a voice, a stored prompt, an audio format,
modalities, a token limit) serve `response.create`'s overrides too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

from gateway.config import GatewayConfig
from gateway.protocol.audio import AudioFormat, AudioFormatError, format_from_beta, format_from_ga
from gateway.protocol.events import (
    AudioInputIn,
    BetaSessionIn,
    BetaTranscriptionSessionIn,
    GASessionIn,
    GATranscriptionSessionIn,
    NoiseReductionIn,
    PromptIn,
    TracingIn,
    TranscriptionIn,
    TurnDetectionIn,
    VoiceIdIn,
)
from gateway.protocol.prompts import PromptError, StoredPrompt, render_prompt
from gateway.protocol.session_config import (
    DEFAULT_TRANSCRIPTION,
    LOGPROBS,
    TRANSCRIPTION_MODELS,
    SessionSettings,
    SettingError,
    TurnDetection,
)
from gateway.protocol.tools import ToolSettingError, check_choice, parse_tool_choice, parse_tools
from gateway.session.input_processing import NoiseReduction

__all__ = [
    "apply_update",
    "beta_format",
    "check_voice",
    "ga_format",
    "read_max_tokens",
    "read_modalities",
    "stored_prompt",
    "voice_name",
]

# server_vad's tuning fields, which semantic_vad does not take.
_SERVER_VAD_ONLY = ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms")
_NEVER_RESPONDS = "a transcription session only transcribes input audio and never responds"


def apply_update(
    current: SessionSettings,
    raw: dict[str, Any],
    *,
    beta: bool,
    config: GatewayConfig,
    voice_locked: bool,
) -> SessionSettings:
    """The settings after a `session.update` (or, for a beta transcription session, a
    `transcription_session.update`); raises SettingError, leaving `current` as is."""
    if not beta:
        _check_type(raw, current)
    if current.transcription_only:
        return _transcription_update(current, raw, beta=beta, config=config)
    update: GASessionIn | BetaSessionIn
    if beta:
        update = BetaSessionIn.model_validate(raw)
        changes = _beta_changes(update, current)
    else:
        update = GASessionIn.model_validate(raw)
        changes = _ga_changes(update, current, config)
    changes.update(_shared_changes(update, current, config))
    new = replace(current, **changes)
    _check_supported(new, current, config, voice_locked)
    _check_semantic(new, config, beta=beta)
    return new


def _check_type(raw: dict[str, Any], current: SessionSettings) -> None:
    """A session's type is fixed when it connects, as the service fixes it."""
    kind = raw.get("type")
    if kind not in ("realtime", "transcription") or kind == current.type:
        return  # a missing or unknown type is the event model's to refuse
    if current.transcription_only:
        message = (
            "Passing a realtime session update event to a transcription session is not "
            "allowed: the session type is set when connecting; connect without "
            "?intent=transcription for a conversation"
        )
    else:
        message = (
            "Passing a transcription session update event to a realtime session is not "
            "allowed: the session type is set when connecting; connect with "
            "?intent=transcription for a transcription session"
        )
    raise SettingError(message, "session.type")


def _check_semantic(new: SessionSettings, config: GatewayConfig, *, beta: bool) -> None:
    if new.turn_detection and new.turn_detection.semantic and not config.semantic_vad:
        where = "session.turn_detection" if beta else "session.audio.input.turn_detection"
        raise SettingError(
            "semantic_vad needs the turn-end model, which this server has not loaded "
            "(profile stages.turn.model); use server_vad or null",
            f"{where}.type",
        )


def _transcription_update(
    current: SessionSettings, raw: dict[str, Any], *, beta: bool, config: GatewayConfig
) -> SessionSettings:
    """A transcription session's update: input settings and `include`, nothing else."""
    model = BetaTranscriptionSessionIn if beta else GATranscriptionSessionIn
    _refuse_output_settings(raw, sorted(model.model_fields))
    changes: dict[str, Any]
    if beta:
        beta_update = BetaTranscriptionSessionIn.model_validate(raw)
        changes = _beta_transcription_changes(beta_update, current)
        given = beta_update.model_fields_set
        include = beta_update.include
    else:
        ga_update = GATranscriptionSessionIn.model_validate(raw)
        audio = ga_update.audio
        changes = _ga_input_changes(audio.input, current) if audio and audio.input else {}
        given = ga_update.model_fields_set
        include = ga_update.include
    if "include" in given:
        changes["include"] = _include(include)
    new = replace(current, **changes)
    _check_language(new, config, beta=beta)
    _check_semantic(new, config, beta=beta)
    return new


def _refuse_output_settings(raw: dict[str, Any], fields: list[str]) -> None:
    """Output settings (voice, instructions, tools...) have nothing to apply to."""
    names = [name for name in raw if name not in fields]
    audio = raw.get("audio")
    if isinstance(audio, dict):
        names += [f"audio.{name}" for name in audio if name != "input"]
    if names:
        raise SettingError(
            f"{names[0]} does not apply: {_NEVER_RESPONDS}; its session takes "
            f"{', '.join(f for f in fields if f not in ('id', 'object', 'expires_at'))}",
            f"session.{names[0]}",
            "unknown_parameter",
        )


def _beta_transcription_changes(
    update: BetaTranscriptionSessionIn, current: SessionSettings
) -> dict[str, Any]:
    if update.modalities is not None and update.modalities != ["text"]:
        raise SettingError(f"modalities is ['text']: {_NEVER_RESPONDS}", "session.modalities")
    return _beta_input_changes(update, current)


def _beta_input_changes(
    update: BetaSessionIn | BetaTranscriptionSessionIn, current: SessionSettings
) -> dict[str, Any]:
    """The input settings, which both beta shapes spell alike."""
    given = update.model_fields_set
    changes: dict[str, Any] = {}
    if update.input_audio_format is not None:
        changes["input_format"] = beta_format(update.input_audio_format, "input_audio_format")
    if "input_audio_transcription" in given:
        changes["transcription"] = _transcription(
            update.input_audio_transcription, "session.input_audio_transcription"
        )
    if "input_audio_noise_reduction" in given:
        changes["noise_reduction"] = _noise_reduction(update.input_audio_noise_reduction)
    if "turn_detection" in given:
        detect = _transcription_detection if current.transcription_only else _turn_detection
        changes["turn_detection"] = detect(
            update.turn_detection, current.turn_detection, "session.turn_detection"
        )
    return changes


def _transcription_detection(
    value: TurnDetectionIn | None, current: TurnDetection | None, param: str
) -> TurnDetection | None:
    """Turn detection that commits speech for transcription and nothing more."""
    if value is None:
        return None
    for name in ("create_response", "interrupt_response"):
        if getattr(value, name):
            raise SettingError(f"{name} must be false: {_NEVER_RESPONDS}", f"{param}.{name}")
    if value.idle_timeout_ms is not None:
        raise SettingError(
            f"idle_timeout_ms starts a response after a silence: {_NEVER_RESPONDS}",
            f"{param}.idle_timeout_ms",
        )
    detection = _turn_detection(value, current, param)
    assert detection is not None
    return replace(detection, create_response=False, interrupt_response=False)


def _include(values: list[str] | None) -> tuple[str, ...]:
    for index, value in enumerate(values or ()):
        if value != LOGPROBS:
            raise SettingError(
                f"include takes only {LOGPROBS!r} (each transcript token's log "
                f"probability); {value!r} is not supported",
                f"session.include.{index}",
            )
    return tuple(dict.fromkeys(values or ()))


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
    if "tracing" in given:
        changes["tracing"] = _tracing(update.tracing, current.tracing)
    if "include" in given:
        changes["include"] = _include(update.include)
    return changes


def _tracing(value: Literal["auto"] | TracingIn | None, current: object) -> object:
    # As the service rules: once a session traces, its tracing stays as it is.
    if current is not None and value != current:
        raise SettingError(
            "tracing cannot be modified once it is enabled for a session", "session.tracing"
        )
    return value


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


def _ga_changes(
    update: GASessionIn, current: SessionSettings, config: GatewayConfig
) -> dict[str, Any]:
    if update.type != "realtime":
        raise SettingError("only realtime sessions are supported (type 'realtime')", "session.type")
    given = update.model_fields_set
    changes: dict[str, Any] = {}
    if update.output_modalities is not None:
        changes["output_modalities"] = read_modalities(update.output_modalities, ga=True)
    if "max_output_tokens" in given:
        changes["max_output_tokens"] = read_max_tokens(update.max_output_tokens)
    if "prompt" in given:
        changes["prompt"] = stored_prompt(update.prompt, config, "session.prompt")
    if "truncation" in given and update.truncation is not None:
        changes["truncation"] = update.truncation
    if "parallel_tool_calls" in given:
        changes["parallel_tool_calls"] = update.parallel_tool_calls
    if "reasoning" in given:
        changes["reasoning"] = update.reasoning
    audio = update.audio
    if audio and audio.input:
        changes.update(_ga_input_changes(audio.input, current))
    if audio and audio.output:
        if audio.output.format is not None:
            changes["output_format"] = ga_format(
                audio.output.format.model_dump(exclude_none=True), "session.audio.output.format"
            )
        if audio.output.voice is not None:
            changes["voice"] = voice_name(audio.output.voice, config, "session.voice")
        if audio.output.speed is not None:
            changes["speed"] = audio.output.speed
    return changes


def _ga_input_changes(value: AudioInputIn, current: SessionSettings) -> dict[str, Any]:
    """`audio.input`'s changes, in either session type."""
    given = value.model_fields_set
    changes: dict[str, Any] = {}
    if value.format is not None:
        changes["input_format"] = ga_format(
            value.format.model_dump(exclude_none=True), "session.audio.input.format"
        )
    if "transcription" in given:
        changes["transcription"] = _transcription(
            value.transcription, "session.audio.input.transcription"
        )
    if "noise_reduction" in given:
        changes["noise_reduction"] = _noise_reduction(value.noise_reduction)
    if value.echo_cancellation is not None:
        changes["echo_cancellation"] = value.echo_cancellation
    if "turn_detection" in given:
        param = "session.audio.input.turn_detection"
        detect = _transcription_detection if current.transcription_only else _turn_detection
        changes["turn_detection"] = detect(value.turn_detection, current.turn_detection, param)
    return changes


def _beta_changes(update: BetaSessionIn, current: SessionSettings) -> dict[str, Any]:
    given = update.model_fields_set
    changes: dict[str, Any] = {}
    if update.modalities is not None:
        changes["output_modalities"] = read_modalities(update.modalities, ga=False)
    if update.voice is not None:
        changes["voice"] = update.voice
    if update.speed is not None:
        changes["speed"] = update.speed
    if update.output_audio_format is not None:
        changes["output_format"] = beta_format(update.output_audio_format, "output_audio_format")
    changes |= _beta_input_changes(update, current)
    if update.input_audio_echo_cancellation is not None:
        changes["echo_cancellation"] = update.input_audio_echo_cancellation
    if "temperature" in given:
        changes["temperature"] = update.temperature
    if "max_response_output_tokens" in given:
        changes["max_output_tokens"] = read_max_tokens(update.max_response_output_tokens)
    return changes


def voice_name(value: str | VoiceIdIn, config: GatewayConfig, param: str) -> str:
    """The voice a client asked for; a custom voice's id only names a voice it has."""
    if not isinstance(value, VoiceIdIn):
        return value
    if config.speaker(value.id) is None:
        raise SettingError(
            f"custom voice {value.id!r} is not available: this server makes no voices "
            f"from samples; use one of {', '.join(config.voice_names)}",
            param,
        )
    return value.id


def stored_prompt(value: PromptIn | None, config: GatewayConfig, param: str) -> StoredPrompt | None:
    if value is None:
        return None
    try:
        return render_prompt(value, config, param)
    except PromptError as exc:
        raise SettingError(str(exc), exc.param) from None


def read_modalities(values: Sequence[str], *, ga: bool) -> tuple[str, ...]:
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


def read_max_tokens(value: int | str | None) -> int | None:
    # The event model (`gateway.protocol.values.TokenLimit`) checked the range; "inf" is the
    # model's own limit, which the engine applies when none is given.
    return value if isinstance(value, int) else None


def ga_format(shape: dict[str, Any], param: str) -> AudioFormat:
    try:
        return format_from_ga(shape)
    except AudioFormatError as exc:
        raise SettingError(str(exc), param) from None


def beta_format(name: str, param: str) -> AudioFormat:
    try:
        return format_from_beta(name)
    except AudioFormatError as exc:
        raise SettingError(str(exc), f"session.{param}") from None


def _transcription(value: TranscriptionIn | None, param: str) -> dict[str, Any] | None:
    """Input transcription: a documented model name (the profile's Whisper runs it),
    the language (checked against the model's), and a prompt Whisper reads as the text
    the speech follows."""
    if value is None:
        return None
    model = value.model or DEFAULT_TRANSCRIPTION["model"]
    if model == "gpt-4o-transcribe-diarize":
        raise SettingError(
            "diarization (speaker labels) is not supported; use one of "
            + ", ".join(TRANSCRIPTION_MODELS),
            f"{param}.model",
        )
    if model not in TRANSCRIPTION_MODELS:
        raise SettingError(
            f"unknown transcription model {model!r}; use one of "
            f"{', '.join(TRANSCRIPTION_MODELS)} (each runs this server's Whisper)",
            f"{param}.model",
        )
    return {"model": model, "language": value.language, "prompt": value.prompt}


def _noise_reduction(value: NoiseReductionIn | None) -> NoiseReduction | None:
    return None if value is None else NoiseReduction(value.type)


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
        check_voice(new.voice, config, "session.voice")
    _check_language(new, config, beta=False)


def check_voice(voice: str, config: GatewayConfig, param: str) -> None:
    """A voice name this profile speaks: its own voices and OpenAI's, by its table."""
    if config.speaker(voice) is None:
        raise SettingError(
            f"unknown voice {voice!r}; supported: {', '.join(config.voice_names)}", param
        )


def _check_language(new: SessionSettings, config: GatewayConfig, *, beta: bool) -> None:
    language = (new.transcription or {}).get("language")
    if language and language not in config.transcription_languages:
        where = "session.input_audio_transcription" if beta else "session.audio.input.transcription"
        raise SettingError(
            f"transcription language {language!r} is not supported; supported: "
            f"{', '.join(config.transcription_languages)}",
            f"{where}.language",
        )
