"""Per-response settings: the session's defaults overridden by `response.create`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duplex.turn import Tool, ToolChoice
from gateway.config import GatewayConfig
from gateway.protocol.audio import AudioFormat
from gateway.protocol.events import (
    BetaResponseIn,
    GAResponseIn,
    ItemIn,
    ItemReferenceIn,
    ReasoningIn,
)
from gateway.protocol.prompts import StoredPrompt
from gateway.protocol.session_config import SessionSettings, SettingError
from gateway.protocol.session_update import (
    beta_format,
    check_voice,
    ga_format,
    read_max_tokens,
    read_modalities,
    stored_prompt,
    voice_name,
)
from gateway.protocol.tools import ToolSettingError, check_choice, parse_tool_choice, parse_tools
from gateway.session.conversation import Item

__all__ = ["ResponseOptions", "parse_response_options"]


@dataclass(frozen=True)
class ResponseOptions:
    instructions: str
    output_modalities: tuple[str, ...]
    max_output_tokens: int | None
    voice: str
    output_format: AudioFormat
    out_of_band: bool = False
    metadata: dict[str, str] | None = None
    # None: the conversation; else items (or ids of conversation items) as the context.
    input: list[Item | str] | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    temperature: float | None = None
    parallel_tool_calls: bool | None = None
    prompt: StoredPrompt | None = None
    reasoning: ReasoningIn | None = None

    @classmethod
    def from_session(cls, settings: SessionSettings) -> ResponseOptions:
        return cls(
            instructions=settings.instructions,
            output_modalities=settings.output_modalities,
            max_output_tokens=settings.max_output_tokens,
            voice=settings.voice,
            output_format=settings.output_format,
            tools=settings.tools,
            tool_choice=settings.tool_choice,
            temperature=settings.temperature,
            parallel_tool_calls=settings.parallel_tool_calls,
            prompt=settings.prompt,
            reasoning=settings.reasoning,
        )

    @property
    def system_text(self) -> str:
        """The system message: the stored prompt's text, then the instructions."""
        parts = (self.prompt.text if self.prompt else "", self.instructions)
        return "\n\n".join(part for part in parts if part)


def parse_response_options(
    raw: dict[str, Any], settings: SessionSettings, *, beta: bool, config: GatewayConfig
) -> ResponseOptions:
    """Raises SettingError (or pydantic's ValidationError) for what cannot be honoured."""
    spec: BetaResponseIn | GAResponseIn = (
        BetaResponseIn.model_validate(raw) if beta else GAResponseIn.model_validate(raw)
    )
    options = ResponseOptions.from_session(settings)
    changes: dict[str, Any] = {}
    changes.update(_tool_overrides(spec, options))
    if spec.conversation not in (None, "auto", "none"):
        raise SettingError("conversation must be 'auto' or 'none'", "response.conversation")
    if spec.instructions is not None:
        changes["instructions"] = spec.instructions
    changes["out_of_band"] = spec.conversation == "none"
    changes["metadata"] = spec.metadata
    if spec.input is not None:
        changes["input"] = [_input_entry(entry, settings) for entry in spec.input]
    if isinstance(spec, BetaResponseIn):
        changes.update(_beta_overrides(spec))
    else:
        changes.update(_ga_overrides(spec, config))
    voice = changes.get("voice")
    if voice is not None:
        check_voice(voice, config, "response.voice")
    fields = {**options.__dict__, **changes}
    return ResponseOptions(**fields)


def _tool_overrides(
    spec: BetaResponseIn | GAResponseIn, options: ResponseOptions
) -> dict[str, Any]:
    given = spec.model_fields_set
    try:
        tools = parse_tools(spec.tools, "response.tools") if "tools" in given else options.tools
        choice = options.tool_choice
        if spec.tool_choice is not None:
            choice = parse_tool_choice(spec.tool_choice, "response.tool_choice")
        check_choice(tools, choice, "response.tool_choice")
    except ToolSettingError as exc:
        raise SettingError(str(exc), exc.param) from None
    return {"tools": tools, "tool_choice": choice}


def _ga_overrides(spec: GAResponseIn, config: GatewayConfig) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    given = spec.model_fields_set
    if "prompt" in given:
        changes["prompt"] = stored_prompt(spec.prompt, config, "response.prompt")
    if "parallel_tool_calls" in given:
        changes["parallel_tool_calls"] = spec.parallel_tool_calls
    if "reasoning" in given:
        changes["reasoning"] = spec.reasoning
    if spec.output_modalities is not None:
        changes["output_modalities"] = read_modalities(list[str](spec.output_modalities), ga=True)
    if "max_output_tokens" in spec.model_fields_set:
        changes["max_output_tokens"] = read_max_tokens(spec.max_output_tokens)
    output = spec.audio.output if spec.audio else None
    if spec.audio and spec.audio.input:
        raise SettingError("a response takes no input audio settings", "response.audio.input")
    if output and output.format is not None:
        changes["output_format"] = ga_format(
            output.format.model_dump(exclude_none=True), "response.audio.output.format"
        )
    if output and output.voice is not None:
        changes["voice"] = voice_name(output.voice, config, "response.voice")
    if output and output.speed is not None:
        raise SettingError("speed is a session setting", "response.audio.output.speed")
    return changes


def _beta_overrides(spec: BetaResponseIn) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    if spec.modalities is not None:
        changes["output_modalities"] = read_modalities(list[str](spec.modalities), ga=False)
    if "max_response_output_tokens" in spec.model_fields_set:
        changes["max_output_tokens"] = read_max_tokens(spec.max_response_output_tokens)
    if spec.output_audio_format is not None:
        changes["output_format"] = beta_format(spec.output_audio_format, "output_audio_format")
    if spec.voice is not None:
        changes["voice"] = spec.voice
    if spec.temperature is not None:
        changes["temperature"] = spec.temperature
    return changes


def _input_entry(entry: ItemIn | ItemReferenceIn, settings: SessionSettings) -> Item | str:
    if isinstance(entry, ItemReferenceIn):
        return entry.id
    try:
        return Item.from_client(entry.model_dump(exclude_none=True), settings.input_format)
    except ValueError as exc:
        param = exc.args[1] if len(exc.args) > 1 else "item"
        raise SettingError(str(exc.args[0]), "response.input." + param) from None
