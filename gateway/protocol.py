"""Pydantic models of the Realtime client events (GA and beta shapes) and the server-event
type names of both shapes.

Client events are validated strictly: an unknown field is an error rather than a setting
silently dropped, a boolean is never a number (nor a number a boolean), a number is
finite, text is valid Unicode (no lone surrogates), and a refused value's error states
the rule it broke. `gateway.realtime`'s dispatch table names the model of each event type.
Server events are plain dicts built by the realtime session in the GA shape; `to_beta`
renames them when the client asked for the beta shape.
"""

from __future__ import annotations

import math
import re
import secrets
import string
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
)
from pydantic_core import PydanticCustomError

from gateway.audio import format_from_ga

__all__ = [
    "AppendIn",
    "BetaResponseIn",
    "BetaSessionIn",
    "ContentIn",
    "EmptyIn",
    "GAResponseIn",
    "GASessionIn",
    "ItemCreateIn",
    "ItemIdIn",
    "ItemIn",
    "ItemReferenceIn",
    "METADATA_MAX_KEYS",
    "METADATA_MAX_KEY_CHARS",
    "METADATA_MAX_VALUE_CHARS",
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


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _holds_lone_surrogate(value: object) -> bool:
    """Whether a string anywhere in a JSON value holds a lone surrogate (JSON's `\\ud800`
    escapes decode to one): such text has no UTF-8 form, so nothing below could use it."""
    pending = [value]
    while pending:  # a loop, not recursion: the value may nest as deep as JSON allows
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii() and _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: object) -> object:
        if _holds_lone_surrogate(value):
            raise PydanticCustomError(
                "value_error", "must be valid Unicode text (a lone surrogate is not)"
            )
        return value


# -- numbers: never booleans, always finite, refused with the rule they broke ----------


def _rule_error(rule: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", "must be {rule}", {"rule": rule})


def _span(low: float | None, high: float | None, *, low_open: bool = False) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" of at least {low}"
    opening = "(" if low_open else "["
    return f" in {opening}{low}, {high}]"


def integer(low: int | None = None, high: int | None = None) -> BeforeValidator:
    """An integer in [low, high]: not a boolean, not a float, not a string."""
    rule = "an integer" + _span(low, high)

    def check(value: object) -> object:
        if value is None:
            return value  # whether None is allowed is the field's type's business
        if not isinstance(value, int) or isinstance(value, bool):
            raise _rule_error(rule)
        if (low is not None and value < low) or (high is not None and value > high):
            raise _rule_error(rule)
        return value

    return BeforeValidator(check)


def number(
    low: float | None = None, high: float | None = None, *, low_open: bool = False
) -> BeforeValidator:
    """A finite number (integer or float, never a boolean) in [low, high] or (low, high]."""
    rule = "a finite number" + _span(low, high, low_open=low_open)

    def above_low(value: float) -> bool:
        return low is None or (value > low if low_open else value >= low)

    def check(value: object) -> object:
        if value is None:
            return value
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _rule_error(rule)
        # An integer is finite however long (and too long for math.isfinite).
        finite = isinstance(value, int) or math.isfinite(value)
        if not finite or not above_low(value):
            raise _rule_error(rule)
        if high is not None and value > high:
            raise _rule_error(rule)
        return value

    return BeforeValidator(check)


def _token_limit(value: object) -> object:
    if value == "inf" or value is None:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096:
        return value
    raise _rule_error("an integer in [1, 4096] or 'inf'")


# Output tokens per response: 1..4096, or "inf" for the model's own limit.
TokenLimit = Annotated[int | Literal["inf"] | None, BeforeValidator(_token_limit)]

# Response metadata, as OpenAI documents it: up to 16 string pairs, short keys.
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


def _metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    if value is None:
        return None
    too_long = any(
        len(k) > METADATA_MAX_KEY_CHARS or len(v) > METADATA_MAX_VALUE_CHARS
        for k, v in value.items()
    )
    if len(value) > METADATA_MAX_KEYS or too_long:
        raise PydanticCustomError(
            "value_error",
            f"must have at most {METADATA_MAX_KEYS} keys, each of at most "
            f"{METADATA_MAX_KEY_CHARS} characters, with string values of at most "
            f"{METADATA_MAX_VALUE_CHARS} characters",
        )
    return value


Metadata = Annotated[dict[str, str] | None, AfterValidator(_metadata)]


class TurnDetectionIn(_Strict):
    type: Literal["server_vad", "semantic_vad"] | None = None
    threshold: Annotated[float | None, number(0.0, 1.0, low_open=True)] = None
    prefix_padding_ms: Annotated[int | None, integer(0, 10_000)] = None
    silence_duration_ms: Annotated[int | None, integer(0, 10_000)] = None
    create_response: StrictBool | None = None
    interrupt_response: StrictBool | None = None
    idle_timeout_ms: Annotated[int | None, integer(1_000, 600_000)] = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None


class TranscriptionIn(_Strict):
    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class FormatIn(_Strict):
    type: str
    rate: Annotated[int | None, integer(1)] = None


class AudioInputIn(_Strict):
    format: FormatIn | None = None
    transcription: TranscriptionIn | None = None
    noise_reduction: dict[str, Any] | None = None
    turn_detection: TurnDetectionIn | None = None


class AudioOutputIn(_Strict):
    format: FormatIn | None = None
    voice: str | None = None
    speed: Annotated[float | None, number(0.25, 1.5)] = None


class AudioIn(_Strict):
    input: AudioInputIn | None = None
    output: AudioOutputIn | None = None


class _SharedSessionIn(_Strict):
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
    tracing: Any = None
    prompt: Any = None
    truncation: Any = None
    include: list[str] | None = None


class BetaSessionIn(_SharedSessionIn):
    modalities: list[Literal["text", "audio"]] | None = None
    voice: str | None = None
    input_audio_format: str | None = None
    output_audio_format: str | None = None
    input_audio_transcription: TranscriptionIn | None = None
    input_audio_noise_reduction: dict[str, Any] | None = None
    turn_detection: TurnDetectionIn | None = None
    temperature: Annotated[float | None, number()] = None
    max_response_output_tokens: TokenLimit = None
    speed: Annotated[float | None, number(0.25, 1.5)] = None
    tracing: Any = None
    include: list[str] | None = None


class ContentIn(_Strict):
    type: Literal[
        "input_text", "input_audio", "input_image", "output_text", "output_audio", "text", "audio"
    ]
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None
    image_url: str | None = None
    detail: str | None = None


class ItemIn(_Strict):
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


class ItemReferenceIn(_Strict):
    type: Literal["item_reference"]
    id: str


class _SharedResponseIn(_Strict):
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    conversation: Literal["auto", "none"] | str | None = None
    metadata: Metadata = None
    input: list[ItemIn | ItemReferenceIn] | None = None
    prompt: Any = None


class GAResponseIn(_SharedResponseIn):
    output_modalities: list[Literal["text", "audio"]] | None = None
    max_output_tokens: TokenLimit = None
    audio: AudioIn | None = None


class BetaResponseIn(_SharedResponseIn):
    modalities: list[Literal["text", "audio"]] | None = None
    voice: str | None = None
    output_audio_format: str | None = None
    temperature: Annotated[float | None, number()] = None
    max_response_output_tokens: TokenLimit = None


class _Event(_Strict):
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
