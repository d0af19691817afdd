"""Request lifecycle types shared by the scheduler, the LLM stage and the layers above.

Names, fields and defaults follow the vllm-mlx request module so code written against
it reads the same here. Unlike there, every sampling field is validated on construction
and honoured per request inside a shared batch, and `seed` makes sampling reproducible.
A request that sets one of vllm-mlx's multimodal or paged-cache fields is refused.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "RequestStatus",
    "SamplingParams",
    "Request",
    "RequestOutput",
    "ToolCallDelta",
    "UNSUPPORTED_FIELDS",
]

# vllm-mlx's multimodal and paged-cache request fields. The LLM stage is text-only and
# keeps each request's KV whole, so a request that sets any of them is refused rather
# than served wrong.
UNSUPPORTED_FIELDS = (
    "block_table",
    "shared_prefix_blocks",
    "images",
    "videos",
    "pixel_values",
    "image_grid_thw",
    "attention_mask",
    "multimodal_kwargs",
    "is_multimodal",
)


class RequestStatus(enum.IntEnum):
    """Status of a request in the scheduling system.

    Every finished status sorts after PREEMPTED, which is what `is_finished` relies on.
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finish_reason(status: RequestStatus) -> str | None:
        if status == RequestStatus.FINISHED_STOPPED:
            return "stop"
        if status == RequestStatus.FINISHED_LENGTH_CAPPED:
            return "length"
        if status == RequestStatus.FINISHED_ABORTED:
            return "abort"
        return None


@dataclass
class SamplingParams:
    """Sampling parameters for text generation, applied to their own request only.

    `logits_processors` are called as `fn(tokens, logits) -> logits` (the mlx-lm
    convention) with the request's prompt and output tokens and its `(1, vocab)` logits.
    They must be functions of those arguments: decode draws a row's next token before
    the host has read its last one, so after a finish, abort or preemption a processor
    may have been called once for a draw that is then dropped.
    `seed` gives the request its own random stream, so its samples do not depend on
    which other requests share the batch. As in vllm-mlx, `stop` and `stop_token_ids`
    may be given as None and `stop` as one string; after construction both are lists.
    """

    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logits_processors: list[Callable[..., Any]] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        _require(self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _require(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _require(self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _require(
            self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
            self.repetition_penalty,
        )
        _require(
            math.isfinite(self.presence_penalty),
            "presence_penalty",
            "must be finite",
            self.presence_penalty,
        )
        _require(all(s for s in self.stop), "stop", "must not contain empty strings", self.stop)
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative ints",
            self.stop_token_ids,
        )
        _require(
            all(callable(p) for p in self.logits_processors or []),
            "logits_processors",
            "must be callables",
            self.logits_processors,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _require(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")


@dataclass(eq=False)
class Request:
    """A single inference request in the scheduling system.

    `num_computed_tokens` counts tokens whose KV is in the request's cache;
    `cached_tokens` how many of the prompt were reused from a prompt cache and
    `remaining_tokens` the ones still to prefill. The multimodal and paged-cache fields
    (`UNSUPPORTED_FIELDS`) are carried for compatibility; construction raises ValueError
    naming the first one that is set, since the text-only LLM stage cannot honour it.
    """

    request_id: str
    prompt: str | list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    prompt_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    batch_uid: int | None = None
    prompt_cache: list[Any] | None = None
    cached_tokens: int = 0
    remaining_tokens: list[int] | None = None
    prefix_boundary: int = 0
    block_table: Any | None = None
    shared_prefix_blocks: int = 0
    images: list[Any] | None = None
    videos: list[Any] | None = None
    pixel_values: Any | None = None
    image_grid_thw: Any | None = None
    attention_mask: Any | None = None
    multimodal_kwargs: dict[str, Any] | None = None
    is_multimodal: bool = False
    finish_reason: str | None = None
    first_token_time: float | None = None
    cache_hit_type: str | None = None

    def __post_init__(self) -> None:
        self._reject_unsupported_fields()
        if isinstance(self.prompt, list) and self.prompt_token_ids is None:
            self.prompt_token_ids = list(self.prompt)
        if self.prompt_token_ids is not None and not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.prompt_token_ids)

    def _reject_unsupported_fields(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in UNSUPPORTED_FIELDS:
            value, default = getattr(self, name), defaults[name]
            is_set = value is not None if default is None else value != default
            if is_set:
                raise ValueError(
                    f"Request.{name} is not supported: the LLM stage serves text-only "
                    f"requests from a contiguous KV cache (got a {type(value).__name__})"
                )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> str | None:
        if self.finish_reason is not None:
            return self.finish_reason
        return RequestStatus.get_finish_reason(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_computed_tokens += 1

    def set_finished(self, status: RequestStatus, reason: str | None = None) -> None:
        self.status = status
        self.finish_reason = reason or RequestStatus.get_finish_reason(status)

    def __lt__(self, other: Request) -> bool:
        if self.priority != other.priority:
            return self.priority < other.priority
        return self.arrival_time < other.arrival_time

    def __hash__(self) -> int:
        return hash(self.request_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return False
        return self.request_id == other.request_id


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of function call `index` of a reply: its `name` and the next piece of its
    arguments' JSON text (as chat-completions streams `tool_calls`)."""

    index: int
    name: str
    arguments: str


@dataclass
class RequestOutput:
    """Output for a single request after a generation step.

    `new_token_ids`/`new_text` are this step's delta; `output_token_ids`/`output_text`
    are cumulative. `new_text` never ends inside a UTF-8 character and never contains
    text at or past a stop string. `cached_tokens` counts prompt tokens reused from
    the prompt cache. The `mtp_*` counters stay 0: this engine does no speculative
    decoding. `tool_calls` are this step's function-call deltas; a call's text is never
    in `new_text`.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    mtp_drafts: int = 0
    mtp_accepted: int = 0
    cached_tokens: int = 0
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
