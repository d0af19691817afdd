"""Pydantic models of the Realtime client events (GA and beta shapes) and the server-event
type names of both shapes.

Client events are validated strictly: an unknown field is an error rather than a setting
silently dropped, a boolean is never a number (nor a number a boolean), a number is
finite, text is valid Unicode (no lone surrogates), and a refused value's error states
the rule it broke. `gateway.session.realtime`'s dispatch table names the model of each event type.
Server events are plain dicts built by the realtime session in the GA shape; `to_beta`
renames them when the client asked for the beta shape.
"""

from __future__ import annotations

import secrets
import string
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
)

from gateway.protocol.audio import format_from_ga
from gateway.protocol.values import (
    METADATA_MAX_KEY_CHARS,
    METADATA_MAX_KEYS,
    METADATA_MAX_VALUE_CHARS,
    Metadata,
    StrictModel,
    TokenLimit,
    integer,
    number,
)

__all__ = [
    "AppendIn",
    "AudioInputIn",
    "BetaResponseIn",
    "BetaSessionIn",
    "BetaTranscriptionSessionIn",
    "ContentIn",
    "EmptyIn",
    "GAResponseIn",
    "GASessionIn",
    "GATranscriptionSessionIn",
    "ItemCreateIn",
    "ItemIdIn",
    "ItemIn",
    "ItemReferenceIn",
    "NoiseReductionIn",
    "PromptIn",
    "PromptTextIn",
    "ReasoningIn",
    "RetentionRatioIn",
    "TracingIn",
    "VoiceIdIn",
    "METADATA_MAX_KEYS",
    "METADATA_MAX_KEY_CHARS",
    "METADATA_MAX_VALUE_CHARS",
    "NoiseReductionIn",
    "ResponseCancelIn",
    "ResponseCreateIn",
    "SessionUpdateIn",
    "TruncateIn",
    "TurnDetectionIn",
    "new_id",
    "to_beta",
]

_BASE62 = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    """An id like the service's: a prefix (`event`, `item`, `resp`, `sess`) + 21 base62."""
    return f"{prefix}_" + "".join(secrets.choice(_BASE62) for _ in range(21))


class TurnDetectionIn(StrictModel):
    type: Literal["server_vad", "semantic_vad"] | None = None
    threshold: Annotated[float | None, number(0.0, 1.0, low_open=True)] = None
    prefix_padding_ms: Annotated[int | None, integer(0, 10_000)] = None
    silence_duration_ms: Annotated[int | None, integer(0, 10_000)] = None
    create_response: StrictBool | None = None
    interrupt_response: StrictBool | None = None
    idle_timeout_ms: Annotated[int | None, integer(1_000, 600_000)] = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None


class TranscriptionIn(StrictModel):
    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class FormatIn(StrictModel):
    type: str
    rate: Annotated[int | None, integer(1)] = None


class NoiseReductionIn(StrictModel):
    type: Literal["near_field", "far_field"]


class AudioInputIn(StrictModel):
    format: FormatIn | None = None
    transcription: TranscriptionIn | None = None
    noise_reduction: NoiseReductionIn | None = None
    turn_detection: TurnDetectionIn | None = None
    # This gateway's own: the server-side echo canceller (docs/protocol.md).
    echo_cancellation: StrictBool | None = None


class VoiceIdIn(StrictModel):
    """A custom voice, by its id (`{"id": "voice_1234"}`)."""

    id: str


class AudioOutputIn(StrictModel):
    format: FormatIn | None = None
    voice: str | VoiceIdIn | None = None
    speed: Annotated[float | None, number(0.25, 1.5)] = None


class TracingIn(StrictModel):
    """Where a session's trace goes, under which workflow name and group."""

    model_config = ConfigDict(frozen=True)

    workflow_name: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] | None = None


Tracing = Literal["auto"] | TracingIn | None


class ReasoningIn(StrictModel):
    model_config = ConfigDict(frozen=True)

    effort: Literal["minimal", "low", "medium", "high", "xhigh"] | None = None


class TokenLimitsIn(StrictModel):
    post_instructions: Annotated[int | None, integer(1)] = None


class RetentionRatioIn(StrictModel):
    """Truncation that, once the conversation is over its limit, drops the oldest
    messages until `retention_ratio` of the limit is used."""

    model_config = ConfigDict(frozen=True)

    type: Literal["retention_ratio"]
    retention_ratio: Annotated[float, number(0.0, 1.0)]
    token_limits: TokenLimitsIn | None = None


Truncation = Literal["auto", "disabled"] | RetentionRatioIn


class PromptTextIn(StrictModel):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None


class PromptMediaIn(StrictModel):
    """An image or file as a prompt variable's value; the LLM takes text only."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_image", "input_file"]


class PromptIn(StrictModel):
    """A stored prompt (kept in the profile), by id and version, with its variables."""

    id: str
    version: str | None = None
    variables: dict[str, str | PromptTextIn | PromptMediaIn] | None = None


class AudioIn(StrictModel):
    input: AudioInputIn | None = None
    output: AudioOutputIn | None = None


class _SharedSessionIn(StrictModel):
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # Echoed by clients that send back the session object they were given.
    id: str | None = None
    object: str | None = None
    expires_at: Annotated[int | None, integer()] = None


class GASessionIn(_SharedSessionIn):
    type: Literal["realtime", "transcription"]
    output_modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioIn | None = None
    max_output_tokens: TokenLimit = None
    tracing: Tracing = None
    prompt: PromptIn | None = None
    truncation: Truncation | None = None
    include: list[str] | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: ReasoningIn | None = None


class ClientSecretIn(StrictModel):
    """A beta session's ephemeral-key lifetime (`client_secret.expires_after`)."""

    expires_after: dict[str, Any] | None = None


class BetaSessionIn(_SharedSessionIn):
    modalities: list[Literal["text", "audio"]] | None = None
    voice: str | None = None
    input_audio_format: str | None = None
    output_audio_format: str | None = None
    input_audio_transcription: TranscriptionIn | None = None
    input_audio_noise_reduction: NoiseReductionIn | None = None
    input_audio_echo_cancellation: StrictBool | None = None
    turn_detection: TurnDetectionIn | None = None
    temperature: Annotated[float | None, number(0.6, 1.2)] = None
    max_response_output_tokens: TokenLimit = None
    speed: Annotated[float | None, number(0.25, 1.5)] = None
    tracing: Tracing = None
    include: list[str] | None = None
    client_secret: ClientSecretIn | None = None


class TranscriptionAudioIn(StrictModel):
    input: AudioInputIn | None = None


class _TranscriptionSessionIn(StrictModel):
    include: list[str] | None = None
    # Echoed by clients that send back the session object they were given.
    id: str | None = None
    object: str | None = None
    expires_at: Annotated[int | None, integer()] = None


class GATranscriptionSessionIn(_TranscriptionSessionIn):
    """A GA transcription session's update: input audio only, it never responds."""

    type: Literal["transcription"]
    audio: TranscriptionAudioIn | None = None


class BetaTranscriptionSessionIn(_TranscriptionSessionIn):
    """The session of a beta `transcription_session.update`."""

    input_audio_format: str | None = None
    input_audio_transcription: TranscriptionIn | None = None
    turn_detection: TurnDetectionIn | None = None
    input_audio_noise_reduction: NoiseReductionIn | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    client_secret: ClientSecretIn | None = None


class ContentIn(StrictModel):
    type: Literal[
        "input_text", "input_audio", "input_image", "output_text", "output_audio", "text", "audio"
    ]
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None
    image_url: str | None = None
    detail: str | None = None


class ItemIn(StrictModel):
    id: str | None = Field(None, max_length=64)
    type: Literal["message", "function_call", "function_call_output"]
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    role: Literal["user", "assistant", "system"] | None = None
    content: list[ContentIn] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class ItemReferenceIn(StrictModel):
    type: Literal["item_reference"]
    id: str


class _SharedResponseIn(StrictModel):
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    conversation: Literal["auto", "none"] | str | None = None
    metadata: Metadata = None
    input: list[ItemIn | ItemReferenceIn] | None = None


class GAResponseIn(_SharedResponseIn):
    output_modalities: list[Literal["text", "audio"]] | None = None
    max_output_tokens: TokenLimit = None
    audio: AudioIn | None = None
    prompt: PromptIn | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: ReasoningIn | None = None


class BetaResponseIn(_SharedResponseIn):
    modalities: list[Literal["text", "audio"]] | None = None
    voice: str | None = None
    output_audio_format: str | None = None
    temperature: Annotated[float | None, number(0.6, 1.2)] = None
    max_response_output_tokens: TokenLimit = None


class _Event(StrictModel):
    type: str
    event_id: str | None = None


class SessionUpdateIn(_Event):
    session: dict[str, Any]


class AppendIn(_Event):
    audio: str


class EmptyIn(_Event):
    """A client event that carries nothing but its type (and optional event_id)."""


class ItemCreateIn(_Event):
    item: dict[str, Any]
    previous_item_id: str | None = None


class ItemIdIn(_Event):
    item_id: str


class TruncateIn(_Event):
    item_id: str
    content_index: Annotated[int, integer(0)]
    audio_end_ms: Annotated[int, integer(0)]


class ResponseCreateIn(_Event):
    response: dict[str, Any] | None = None


class ResponseCancelIn(_Event):
    response_id: str | None = None


_BETA_TYPES = {
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "conversation.item.added": "conversation.item.created",
}
_BETA_CONTENT = {"output_text": "text", "output_audio": "audio"}


def _beta_item(item: dict[str, Any]) -> dict[str, Any]:
    content = [
        {**part, "type": _BETA_CONTENT.get(part["type"], part["type"])}
        for part in item.get("content", [])
    ]
    return {**item, "content": content} if "content" in item else item


def to_beta(event: dict[str, Any]) -> dict[str, Any] | None:
    """The beta spelling of a GA server event, or None where beta has no such event."""
    kind = event["type"]
    if kind == "conversation.item.done":
        return None  # beta announces an item once, as conversation.item.created
    out = {**event, "type": _BETA_TYPES.get(kind, kind)}
    if "item" in out:
        out["item"] = _beta_item(out["item"])
    if kind in ("response.created", "response.done"):
        out["response"] = _beta_response(out["response"])
    return out


def _beta_response(response: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in response.items() if k not in ("output_modalities", "audio")}
    out["modalities"] = response["output_modalities"]
    out["voice"] = response["audio"]["output"]["voice"]
    out["output_audio_format"] = format_from_ga(response["audio"]["output"]["format"]).beta_name
    out["max_response_output_tokens"] = out.pop("max_output_tokens")
    out["output"] = [_beta_item(item) for item in response["output"]]
    return out
