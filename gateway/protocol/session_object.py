"""The session object a client is shown: the settings rendered whole, as
`session.created` and `session.updated` carry them (and a minted client secret's
`session`), in the GA or the beta shape, for a realtime or a transcription session."""

from __future__ import annotations

from typing import Any

from gateway.protocol.events import RetentionRatioIn, TracingIn
from gateway.protocol.session_config import SessionSettings, TurnDetection
from gateway.protocol.tools import tool_choice_object, tool_objects

__all__ = ["beta_session_object", "ga_session_object"]


def ga_session_object(settings: SessionSettings) -> dict[str, Any]:
    if settings.transcription_only:
        return _ga_transcription_object(settings)
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": settings.id,
        "model": settings.model,
        "output_modalities": list(settings.output_modalities),
        "instructions": settings.instructions,
        "tools": tool_objects(settings.tools),
        "tool_choice": tool_choice_object(settings.tool_choice),
        "max_output_tokens": "inf"
        if settings.max_output_tokens is None
        else settings.max_output_tokens,
        "tracing": _tracing_object(settings),
        "prompt": settings.prompt and settings.prompt.as_dict(),
        "truncation": _truncation_object(settings),
        "parallel_tool_calls": settings.parallel_tool_calls,
        "reasoning": settings.reasoning and settings.reasoning.model_dump(exclude_none=True),
        "expires_at": settings.expires_at,
        "include": _include_object(settings),
        "audio": {
            "input": {
                "format": settings.input_format.ga_shape(),
                "transcription": settings.transcription,
                "noise_reduction": _noise_reduction_object(settings),
                "turn_detection": settings.turn_detection
                and _turn_detection_object(settings.turn_detection),
                "echo_cancellation": settings.echo_cancellation,
            },
            "output": {
                "format": settings.output_format.ga_shape(),
                "voice": settings.voice,
                "speed": settings.speed,
            },
        },
    }


def _ga_transcription_object(settings: SessionSettings) -> dict[str, Any]:
    detection = settings.turn_detection
    return {
        "type": "transcription",
        "object": "realtime.transcription_session",
        "id": settings.id,
        "expires_at": settings.expires_at,
        "include": _include_object(settings),
        "audio": {
            "input": {
                "format": settings.input_format.ga_shape(),
                "transcription": settings.transcription,
                "noise_reduction": _noise_reduction_object(settings),
                "turn_detection": detection and _transcription_turn_detection_object(detection),
            },
        },
    }


def beta_session_object(settings: SessionSettings) -> dict[str, Any]:
    if settings.transcription_only:
        return _beta_transcription_object(settings)
    return {
        "object": "realtime.session",
        "id": settings.id,
        "model": settings.model,
        "modalities": list(settings.output_modalities),
        "instructions": settings.instructions,
        "voice": settings.voice,
        "speed": settings.speed,
        "input_audio_format": settings.input_format.beta_name,
        "output_audio_format": settings.output_format.beta_name,
        "input_audio_transcription": settings.transcription,
        "input_audio_noise_reduction": _noise_reduction_object(settings),
        "input_audio_echo_cancellation": settings.echo_cancellation,
        "turn_detection": settings.turn_detection
        and _turn_detection_object(settings.turn_detection),
        "tools": tool_objects(settings.tools),
        "tool_choice": tool_choice_object(settings.tool_choice),
        "max_response_output_tokens": "inf"
        if settings.max_output_tokens is None
        else settings.max_output_tokens,
        "temperature": settings.temperature,
        "tracing": _tracing_object(settings),
        "expires_at": settings.expires_at,
        "include": _include_object(settings),
    }


def _beta_transcription_object(settings: SessionSettings) -> dict[str, Any]:
    detection = settings.turn_detection
    return {
        "object": "realtime.transcription_session",
        "id": settings.id,
        "expires_at": settings.expires_at,
        "modalities": ["text"],
        "input_audio_format": settings.input_format.beta_name,
        "input_audio_transcription": settings.transcription,
        "input_audio_noise_reduction": _noise_reduction_object(settings),
        "turn_detection": detection and _transcription_turn_detection_object(detection),
        "include": _include_object(settings),
        # The beta SDK's model requires it. Sessions here are opened over the
        # WebSocket with the server's key: no ephemeral key is issued, so it is empty.
        "client_secret": {"value": "", "expires_at": settings.expires_at},
    }


def _turn_detection_object(detection: TurnDetection) -> dict[str, Any]:
    if detection.semantic:
        return {
            "type": "semantic_vad",
            "eagerness": detection.eagerness,
            "create_response": detection.create_response,
            "interrupt_response": detection.interrupt_response,
        }
    return {
        "type": "server_vad",
        "threshold": detection.threshold,
        "prefix_padding_ms": detection.prefix_padding_ms,
        "silence_duration_ms": detection.silence_duration_ms,
        "idle_timeout_ms": detection.idle_timeout_ms,
        "create_response": detection.create_response,
        "interrupt_response": detection.interrupt_response,
    }


def _transcription_turn_detection_object(detection: TurnDetection) -> dict[str, Any]:
    """As a transcription session shows it: no responses to create or interrupt."""
    if detection.semantic:
        return {"type": "semantic_vad", "eagerness": detection.eagerness}
    return {
        "type": "server_vad",
        "threshold": detection.threshold,
        "prefix_padding_ms": detection.prefix_padding_ms,
        "silence_duration_ms": detection.silence_duration_ms,
    }


def _truncation_object(settings: SessionSettings) -> str | dict[str, Any]:
    if isinstance(settings.truncation, RetentionRatioIn):
        return settings.truncation.model_dump(exclude_none=True)
    return settings.truncation


def _tracing_object(settings: SessionSettings) -> str | dict[str, Any] | None:
    if isinstance(settings.tracing, TracingIn):
        return settings.tracing.model_dump(exclude_none=True)
    return settings.tracing


def _noise_reduction_object(settings: SessionSettings) -> dict[str, str] | None:
    return {"type": settings.noise_reduction.type} if settings.noise_reduction else None


def _include_object(settings: SessionSettings) -> list[str] | None:
    return list(settings.include) or None
