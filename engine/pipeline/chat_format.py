"""A turn's conversation in the chat-completions shape the LLM's chat template takes.

The turn request (`duplex.turn`) carries typed messages, tools and a tool choice; the
LLM stage, local or remote, reads plain dicts: `{"role": ..., "content": ...}` messages,
`{"type": "function", ...}` tools, and a tool choice that is a mode or a named function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from duplex.turn import Message, Tool, ToolChoice

__all__ = ["chat_messages", "chat_tool_choice", "chat_tools"]


def chat_messages(
    history: Sequence[Message], system_prompt: str, text: str | None
) -> list[dict[str, Any]]:
    """The conversation the LLM answers: `history`, led by `system_prompt` unless it
    opens with a system message of its own, then `text` as the user's new message (a
    turn without one, None, continues from the history)."""
    messages = [_chat_message(m) for m in history]
    if not messages or messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if text is not None:
        messages.append({"role": "user", "content": text})
    return messages


def chat_tools(tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    """The tools the LLM may call; None when the turn offers none."""
    return [_chat_tool(t) for t in tools] or None


def chat_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.name is not None:
        return {"type": "function", "function": {"name": choice.name}}
    return choice.mode


def _chat_message(message: Message) -> dict[str, Any]:
    """A turn's message in the chat-completions shape."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _chat_tool(tool: Tool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.schema}
    return {"type": "function", "function": function}
