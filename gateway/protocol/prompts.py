"""Stored prompts: the `prompt` of a session or response, by id, version and variables.

A profile keeps its prompts under `gateway.prompts` as `{id: {version: text}}`; without
a version a client gets the last one listed. `{{name}}` in the text is a variable: a
client gives every variable the text uses, as a string or an `input_text` part, and
nothing else (the LLM reads text, so an image or a file cannot stand in one). The
rendered text opens the system message, before the instructions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig
from gateway.protocol.events import PromptIn, PromptTextIn

__all__ = ["PromptError", "StoredPrompt", "render_prompt"]

_VARIABLE = re.compile(r"\{\{\s*([A-Za-z0-9_.-]+)\s*\}\}")


class PromptError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StoredPrompt:
    """A prompt as a session or response uses it: what the client asked for, and the
    text it renders to."""

    id: str
    version: str
    variables: tuple[tuple[str, str], ...]
    text: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "version": self.version, "variables": dict(self.variables) or None}


def render_prompt(spec: PromptIn, config: GatewayConfig, param: str) -> StoredPrompt:
    """The prompt `spec` asks for, its variables filled in; raises PromptError."""
    versions = config.prompts.get(spec.id)
    if not versions:
        known = ", ".join(config.prompts) or "none"
        raise PromptError(
            f"unknown prompt {spec.id!r}; the prompts stored in this server's profile "
            f"(gateway.prompts): {known}",
            f"{param}.id",
        )
    version = spec.version or list(versions)[-1]
    if version not in versions:
        raise PromptError(
            f"prompt {spec.id!r} has no version {version!r}; it has {', '.join(versions)}",
            f"{param}.version",
        )
    template = versions[version]
    given = (spec.variables or {}).items()
    values = {name: _text(value, f"{param}.variables.{name}") for name, value in given}
    used = set(_VARIABLE.findall(template))
    for name in sorted(used - values.keys()):
        raise PromptError(f"prompt {spec.id!r} needs the variable {name!r}", f"{param}.variables")
    for name in sorted(values.keys() - used):
        raise PromptError(
            f"prompt {spec.id!r} (version {version!r}) has no variable {name!r}",
            f"{param}.variables.{name}",
        )
    text = _VARIABLE.sub(lambda match: values[match.group(1)], template)
    return StoredPrompt(spec.id, version, tuple(sorted(values.items())), text)


def _text(value: object, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, PromptTextIn):
        return value.text
    raise PromptError(
        "a prompt variable takes text (a string or an input_text part): the LLM behind "
        "this server reads no images or files",
        param,
    )
