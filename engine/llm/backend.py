"""Where a turn's LLM stage runs: the engine's own LLM stage, or a remote server.

`LlmBackend` is what the turn runner asks of either; `EngineLlm` is the engine thread's
"llm" stage behind it (the remote one is `engine.llm.remote_llm.RemoteLlm`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.llm.stage import LlmInput
from engine.runtime import clients
from engine.runtime.core import AsyncEngine
from engine.runtime.stage import StageOutput

__all__ = ["EngineLlm", "LlmBackend"]


class LlmBackend(Protocol):
    """Where stage 1 runs: the engine's LLM stage, or a remote server."""

    def stream(self, request_id: str, inputs: LlmInput) -> AsyncIterator[StageOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def forget(self, cache_key: str) -> None:
        """The conversation under `cache_key` is over: free what is cached for it."""


class EngineLlm:
    """The engine thread's "llm" stage as an `LlmBackend`."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def stream(self, request_id: str, inputs: LlmInput) -> AsyncIterator[StageOutput]:
        return self._engine.stream("llm", request_id, inputs)

    def abort(self, request_id: str) -> None:
        self._engine.abort("llm", request_id)

    def forget(self, cache_key: str) -> None:
        # Queued behind the session's aborts, which the engine thread takes first.
        clients.llm(self._engine).notify(lambda llm: llm.forget(cache_key))
