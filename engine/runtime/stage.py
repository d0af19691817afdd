"""The one interface every engine stage (ASR, LLM, TTS, VAD) implements.

A stage is synchronous and is driven only by the engine thread (`engine.runtime.core`): the
thread calls `abort` first, then `add`/`feed`, then `step` once per busy stage per loop
iteration. A stage never blocks on I/O and never touches asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class StageOutput:
    """One increment of a stage request's result.

    `payload` is stage-specific (LLM: `engine.runtime.request.RequestOutput`; ASR: the
    transcript text; TTS: an `engine.stages.tts.AudioChunk`). `finished` is true on the last
    output of a request; `error` is set (and `finished` true) when the request failed,
    with `error_code` when the stage refused what the request asked (`RequestRefused`).
    """

    request_id: str
    payload: Any
    finished: bool = False
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error_code: str | None = None


class RequestRefused(ValueError):
    """`add` refuses a request for what it asks, not for a fault of the stage; `code`
    names the rule so that the client's error can say which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Stage(Protocol):
    name: str

    def add(self, request_id: str, inputs: Any) -> None:
        """Admit a new request. Raises ValueError for inputs the stage cannot take."""

    def abort(self, request_id: str) -> None:
        """Forget a request at once: no output of it is returned by any later step."""

    def has_work(self) -> bool:
        """Whether `step` would do anything."""

    def step(self) -> list[StageOutput]:
        """Do one bounded unit of work (batched across requests where possible)."""
