"""One live request of the LLM stage: its tokens so far and what its scheduler, model
runner and output processor keep for it between steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.llm.detokenizer import StreamingDetokenizer
from engine.llm.sampling import RowSampler
from engine.llm.tool_calls import CallReader
from engine.runtime.request import Request

__all__ = ["LlmSequence"]


@dataclass(eq=False)
class LlmSequence:
    """A live request and its generation state; its comments cite the rules of
    `engine.llm.stage`, of the runner (`engine.llm.model_runner`) and of the scheduler
    (`engine.llm.scheduler`)."""

    req: Request
    tokens: list[int]  # prompt + output so far
    sampler: RowSampler
    detok: StreamingDetokenizer
    cache_key: str | None
    calls: CallReader | None = None  # with tools: reads the reply's calls (stage rule 1)
    layers: list[Any] = field(default_factory=list)  # per-layer KV while prefilling
    unread: bool = False  # its pending decode input is drawn, not recorded (runner rule 1)
    rewind_key: mx.array | None = None  # its sampler key before that draw
    added_at: float = 0.0  # stage clock at `add`
    speech_until: float | None = None  # when its queued speech runs out (scheduler rule 3)

    @property
    def kv_tokens(self) -> int:
        return self.req.num_computed_tokens
