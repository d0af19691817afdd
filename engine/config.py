"""The engine profile: which model runs each stage, how it samples, and engine limits.

Profiles are YAML files (`configs/*.yaml`) validated by the pydantic models below. Unknown
keys are errors, and every error names its place in the file (`stages.llm.sampling.top_p`).
The top-level `gateway:` mapping belongs to the gateway and is validated there.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    from engine.runtime.request import SamplingParams

__all__ = [
    "AsrConfig",
    "ClauseConfig",
    "ConfigError",
    "ContextConfig",
    "EngineConfig",
    "EngineLimits",
    "LlmConfig",
    "ModelRef",
    "RemoteLlmConfig",
    "SamplingConfig",
    "TtsConfig",
    "TurnConfig",
    "VadConfig",
    "load_config",
    "parse_config",
]

DEFAULT_SYSTEM_PROMPT = (
    "You are a friendly voice assistant. Answer in one or two short, plain sentences "
    "that sound natural when spoken aloud. Do not use lists, markdown or emoji."
)


DEFAULT_LLM = "smollm2-135m-instruct"


class ConfigError(ValueError):
    """A profile that cannot be used; the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(_Strict):
    """A model by registry name; `source`/`converter` register a name the registry lacks
    (e.g. `source: hf:mlx-community/...` on a machine with network)."""

    name: str = Field(min_length=1)
    source: str | None = None
    converter: str | None = None
    precision: Literal["auto", "fp32", "4bit"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _converter_needs_source(self) -> ModelRef:
        if self.converter is not None and self.source is None:
            raise ValueError("'converter' is only used together with 'source'")
        return self


class SamplingConfig(_Strict):
    """Default LLM sampling; each field maps onto `engine.runtime.request.SamplingParams`."""

    max_tokens: int = Field(96, ge=1)
    temperature: float = Field(0.7, ge=0.0)
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = 0.0
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop: tuple[str, ...] = ()

    def to_params(self, *, max_tokens: int | None = None) -> SamplingParams:
        from engine.runtime.request import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=list(self.stop),
        )


class RemoteLlmConfig(_Strict):
    """An OpenAI-compatible chat-completions server used as the LLM stage."""

    base_url: str = Field(pattern=r"^https?://")
    model: str = Field(min_length=1)
    api_key: str | None = None
    timeout_s: float = Field(30.0, gt=0.0)


class ContextConfig(_Strict):
    """What one turn may put in front of the local model, in tokens (`engine.llm.context`):
    each is refused with an error naming it, except that history over
    `max_context_tokens` is truncated, oldest first, when the session allows it."""

    max_instructions_tokens: int = Field(4096, ge=1)
    max_user_message_tokens: int = Field(4096, ge=1)
    max_context_tokens: int = Field(6144, ge=16)


class LlmConfig(_Strict):
    """`model` is the local model (backend "local"); `remote` the server (backend "remote").
    `context` bounds the local model's prompts; a remote server applies its own.

    `call_threshold` (local model, `tool_choice: "auto"`): the reply is a call when the
    model gives the tokens that start one at least this share of its probability at the
    reply's first token (`engine.llm.grammar`); 0: only when its own draw starts one."""

    backend: Literal["local", "remote"] = "local"
    model: ModelRef | None = None
    sampling: SamplingConfig = SamplingConfig()
    remote: RemoteLlmConfig | None = None
    context: ContextConfig | None = None
    call_threshold: float = Field(0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _backend_settings(self) -> LlmConfig:
        if self.backend == "remote":
            if self.remote is None:
                raise ValueError("backend 'remote' needs a 'remote:' mapping (base_url, model)")
            if self.model is not None:
                raise ValueError("'model' is not used with backend 'remote'; set remote.model")
            if self.context is not None:
                raise ValueError("'context' limits the local model; a remote server sets its own")
            if self.call_threshold:
                raise ValueError("'call_threshold' is the local model's; a remote server decides")
            return self
        if self.remote is not None:
            raise ValueError("'remote:' is only used with backend 'remote'")
        if self.model is None:
            object.__setattr__(self, "model", ModelRef(name=DEFAULT_LLM))
        if self.context is None:
            object.__setattr__(self, "context", ContextConfig())
        return self


class AsrConfig(_Strict):
    """`max_batch` utterances share one Whisper pass; longer turns than `max_audio_s`
    are refused. While a session listens, its speech is re-transcribed whenever
    `live_interval_ms` more of it has arrived (and none of its partials is running).
    `beam_size` > 1 decodes each final transcript by beam search, 1.4 to 2.2 times
    the time per clip at 5 (live partials and interruption word checks stay greedy); 1 is
    greedy decoding."""

    model: ModelRef = ModelRef(name="whisper-tiny.en")
    beam_size: int = Field(1, ge=1, le=16)
    max_batch: int = Field(4, ge=1)
    max_audio_s: float = Field(120.0, gt=0.0)
    live_interval_ms: int = Field(400, ge=40)
    # Live (partial) transcripts of several sessions batched into one step.
    max_partial_batch: int = Field(4, ge=1)


class TtsConfig(_Strict):
    """`voice` is the name clients use for a one-voice model (Piper), or the default of
    a model with several (Kokoro: one of its voices); None: the model's name, or its
    default voice. `speed` > 1 speaks faster; `max_batch` clauses of different requests
    are spoken in one batched pass."""

    model: ModelRef = ModelRef(name="piper-en_US-joe-medium")
    voice: str | None = Field("joe", min_length=1)
    speed: float = Field(1.0, ge=0.25, le=4.0)
    noise_scale: float | None = Field(None, ge=0.0)
    noise_w: float | None = Field(None, ge=0.0)
    max_batch: int = Field(8, ge=1)

    @property
    def voice_name(self) -> str:
        """The name a one-voice model (Piper) answers to: `voice`, else the model's."""
        return self.voice or self.model.name


class VadConfig(_Strict):
    model: ModelRef = ModelRef(name="silero-vad")


class TurnConfig(_Strict):
    """The turn-end model behind `semantic_vad` (None: no model, semantic_vad refused);
    `max_batch` sessions' turns are scored in one pass."""

    model: ModelRef | None = ModelRef(name="smart-turn-v3.2")
    max_batch: int = Field(8, ge=1)


class ClauseConfig(_Strict):
    """How LLM text is cut into clauses for speech (see `engine.stages.clauses`)."""

    first_min_chars: int = Field(16, ge=1)
    first_max_chars: int = Field(24, ge=8)
    min_chars: int = Field(48, ge=1)
    max_chars: int = Field(160, ge=8)

    @model_validator(mode="after")
    def _ordered(self) -> ClauseConfig:
        if self.first_min_chars > self.first_max_chars or self.min_chars > self.max_chars:
            raise ValueError("min_chars must not exceed max_chars (first clause: likewise)")
        return self


class EngineLimits(_Strict):
    max_running_sequences: int = Field(8, ge=1)
    prefill_chunk_tokens: int = Field(512, ge=16)
    # The most of one long prompt any forward prefills (engine.llm.scheduler's
    # `schedule_prefill`): a new turn's first token waits for at most one such slice of
    # another session's prompt.
    prefill_slice_tokens: int = Field(64, ge=8)
    prompt_cache_bytes: int = Field(256 * 1024 * 1024, ge=0)
    # One tiny request through each stage at start-up, so the first turn is not slow.
    warmup: bool = True


class StagesConfig(_Strict):
    asr: AsrConfig = AsrConfig()
    llm: LlmConfig = LlmConfig()
    tts: TtsConfig = TtsConfig()
    vad: VadConfig = VadConfig()
    turn: TurnConfig = TurnConfig()


class EngineConfig(_Strict):
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, min_length=1)
    stages: StagesConfig = StagesConfig()
    clauses: ClauseConfig = ClauseConfig()
    engine: EngineLimits = EngineLimits()
    gateway: dict[str, Any] = Field(default_factory=dict)


def parse_config(data: Any, *, source: str = "<config>") -> EngineConfig:
    """Validate a loaded mapping; errors name `source` and the key path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, not {type(data).__name__}")
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def load_config(path: str | Path) -> EngineConfig:
    """Read and validate a YAML profile."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, source=str(path))


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {where}: unknown key")
        else:
            lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)
