"""Function tools in the realtime protocol: `tools` and `tool_choice` as the client sends
them (in `session.update` and as `response.create` overrides), read into the typed
values a turn carries (`duplex.turn.Tool`, `ToolChoice`), and rendered back.

Both protocol shapes spell them the same way: a tool is `{type: "function", name,
description, parameters}` with `parameters` a JSON Schema object; `tool_choice` is
`"auto"`, `"none"`, `"required"` or `{type: "function", name}`. Anything else (MCP tools,
a choice naming a function that is not offered) raises `ToolSettingError` naming the
parameter.
"""

from __future__ import annotations

import json
from typing import Any

from duplex.turn import Tool, ToolChoice

__all__ = [
    "ToolSettingError",
    "check_choice",
    "parse_tool_choice",
    "parse_tools",
    "tool_choice_object",
    "tool_objects",
]

_TOOL_FIELDS = {"type", "name", "description", "parameters"}


class ToolSettingError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_tools(raw: list[dict[str, Any]] | None, param: str) -> tuple[Tool, ...]:
    """The function tools of a `tools` list (None or [] clears them)."""
    tools = tuple(_tool(entry, f"{param}.{i}") for i, entry in enumerate(raw or []))
    names = [t.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ToolSettingError(f"two tools are named {duplicate!r}", param)
    return tools


def _tool(entry: dict[str, Any], param: str) -> Tool:
    if entry.get("type") != "function":
        raise ToolSettingError(
            f"only function tools are supported, not {entry.get('type')!r}", f"{param}.type"
        )
    unknown = sorted(set(entry) - _TOOL_FIELDS)
    if unknown:
        raise ToolSettingError(f"unknown tool field {unknown[0]!r}", f"{param}.{unknown[0]}")
    description = entry.get("description") or ""
    if not isinstance(description, str):
        raise ToolSettingError("description must be a string", f"{param}.description")
    parameters = entry.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolSettingError("parameters must be a JSON Schema object", f"{param}.parameters")
    try:
        return Tool(
            name=entry.get("name"),  # type: ignore[arg-type]  # Tool checks it
            description=description,
            parameters=json.dumps(parameters, sort_keys=True),
        )
    except ValueError as exc:
        raise ToolSettingError(str(exc), f"{param}.name") from None


def parse_tool_choice(raw: Any, param: str) -> ToolChoice:
    if raw in ("auto", "none", "required"):
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function" and set(raw) <= {"type", "name"}:
        name = raw.get("name")
        if isinstance(name, str) and name:
            return ToolChoice("function", name)
    raise ToolSettingError(
        "tool_choice must be 'auto', 'none', 'required' or {type: 'function', name}", param
    )


def check_choice(tools: tuple[Tool, ...], choice: ToolChoice, param: str) -> None:
    """A choice that forces a call needs the tool it forces."""
    if choice.must_call and not tools:
        raise ToolSettingError(f"tool_choice {choice.mode!r} needs at least one tool", param)
    if choice.name is not None and choice.name not in {t.name for t in tools}:
        raise ToolSettingError(f"tool_choice names {choice.name!r}, which is not a tool", param)


def tool_objects(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.schema,
        }
        for t in tools
    ]


def tool_choice_object(choice: ToolChoice) -> str | dict[str, str]:
    if choice.name is not None:
        return {"type": "function", "name": choice.name}
    return choice.mode
