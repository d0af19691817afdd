"""Build the running engine from a profile: models, stages, the engine thread, the port.

`build_engine` converts each stage's model into the cache on first use (with a progress
bar), loads the models in a worker thread so the event loop keeps serving, optionally
warms every stage with one tiny request (the first real turn then pays no compile or
allocation cost), and starts the engine thread. `EngineBundle.aclose` undoes it all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.config import EngineConfig, ModelRef
from engine.llm.remote_llm import RemoteLlm
from engine.pipeline.orchestrator import DuplexOrchestrator
from engine.runtime.core import AsyncEngine
from engine.runtime.lanes import EngineLanes
from engine.runtime.stage import Stage, StageOutput
from engine.runtime.urgency import Urgency

__all__ = ["EngineBundle", "build_engine", "cache_system_prompt", "load_stages", "prepare_model"]

logger = logging.getLogger(__name__)

WARMUP_ID = "warmup"
WARMUP_MAX_STEPS = 64
# TTS steps first: a clause that reached it during an LLM step is spoken before the LLM
# takes its next one (LLM first would cost one more LLM step before every clause). A
# TTS thread of its own measured slower on the CPU backend: it competes with the LLM
# for the same cores, so the first chunk takes longer.
MAIN_LANE_ORDER = ("tts", "llm")
# Nice levels the main lane runs below the small lanes (VAD, ASR, turn end).
MAIN_LANE_YIELDS = 5
# The longest an urgent request (an interruption's words) holds the main lane: about
# three times such a transcription on an idle 2-core CPU.
URGENT_HOLD_S = 0.4


@dataclass
class EngineBundle:
    """Everything `build_engine` started; `aclose` stops it (idempotent)."""

    config: EngineConfig
    core: EngineLanes
    engine: AsyncEngine
    orchestrator: DuplexOrchestrator
    remote_llm: RemoteLlm | None = None
    llm_stage: Stage | None = None
    voices: tuple[str, ...] = ()  # the TTS stage's voices, its default first
    openai_voices: dict[str, str] = field(default_factory=dict)
    _closed: bool = False

    def llm_tokens(self) -> dict[str, int]:
        """Tokens the local LLM stage prefilled and decoded so far; none for a remote one."""
        return dict(getattr(self.llm_stage, "token_counts", {}))

    def cache_stats(self) -> dict[str, tuple[int | None, int]]:
        """(entries, bytes) of every cache the engine keeps, by name; entries is None
        where the cache cannot count them (MLX's pool of freed buffers)."""
        import mlx.core as mx

        llm_stats = getattr(self.llm_stage, "cache_stats", None)
        stats: dict[str, tuple[int | None, int]] = dict(llm_stats() if llm_stats else {})
        orchestrator = self.orchestrator
        stats["listener_audio"] = (orchestrator.listener_count(), orchestrator.listened_bytes())
        stats["mlx_buffer_pool"] = (None, mx.get_cache_memory())
        return stats

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.orchestrator.shutdown()
        if self.remote_llm is not None:
            await self.remote_llm.aclose()
        await asyncio.to_thread(self.core.shutdown)


async def build_engine(config: EngineConfig, *, progress: bool = True) -> EngineBundle:
    """Load every stage off the event loop, start the engine thread, wire the port."""
    stages = await asyncio.to_thread(_load_and_warm, config, progress)
    # VAD gets a thread of its own so speech start is never stuck behind a TTS/LLM step.
    # The engine thread steps the others in MAIN_LANE_ORDER.
    heavy = {name: stages[name] for name in MAIN_LANE_ORDER if name in stages}
    lanes = {"main": heavy, "vad": {"vad": stages["vad"]}}
    # ASR has a lane of its own: live partial transcripts and interruption-word checks
    # never wait behind a TTS or LLM step (final transcripts go before partials inside it).
    lanes["asr"] = {"asr": stages["asr"]}
    if "turn" in stages:
        # Turn-end scoring takes tens of ms: on its own thread it delays neither VAD nor TTS.
        lanes["turn"] = {"turn": stages["turn"]}
    # The small lanes answer within a turn's latency (speech start, the words that
    # confirm an interruption, the turn's end); the main lane's TTS and LLM steps run
    # ahead of playback and can wait for them on a busy CPU.
    # The words that may confirm an interruption also hold the main lane while they run.
    urgency = Urgency(max_hold_s=URGENT_HOLD_S)
    for stage in heavy.values():
        # Their steps that take long on a CPU (a large model's prefill forward, a
        # voice's render) give way within themselves as well, between their pieces.
        give_way = getattr(stage, "give_way_with", None)
        if give_way is not None:
            give_way(urgency.pause)
    core = EngineLanes(lanes, yielding={"main": MAIN_LANE_YIELDS}, urgency=urgency)
    core.start()
    engine = AsyncEngine(core)
    llm = config.stages.llm
    remote = RemoteLlm(llm.remote) if llm.backend == "remote" and llm.remote else None
    voices, openai_voices = voice_table(config, stages)
    orchestrator = DuplexOrchestrator(engine, config, llm=remote, voices=voices)
    return EngineBundle(
        config, core, engine, orchestrator, remote, stages.get("llm"), voices, openai_voices
    )


def _load_and_warm(config: EngineConfig, progress: bool) -> dict[str, Stage]:
    import mlx.core as mx

    try:
        stages = load_stages(config, progress=progress)
        if config.engine.warmup:
            warm_up(stages)
        cache_system_prompt(stages, config.system_prompt)
        return stages
    finally:
        # MLX work still in flight when a worker thread goes idle can abort the process
        # at interpreter exit; finish it on the thread that started it.
        mx.synchronize()


def prepare_model(stage: str, ref: ModelRef, *, progress: bool = True) -> Path:
    """The converted directory of `ref`, registering it first when it names a source."""
    from engine.weights import registry

    if ref.source is not None:
        converter = ref.converter or "engine.weights.registry:link_files"
        registry.register(registry.ModelSpec(ref.name, stage, ref.source, converter))
    spec = registry.get_spec(ref.name)
    if spec.stage != stage:
        raise ValueError(f"model {ref.name!r} is a {spec.stage} model, not a {stage} model")
    return registry.prepare(ref.name, progress=progress, precision=ref.precision)


def load_stages(config: EngineConfig, *, progress: bool = True) -> dict[str, Stage]:
    """Build the asr/llm/tts/vad stages (the LLM stage only for the local backend)."""
    loaders: dict[str, Callable[[EngineConfig, bool], Stage]] = {
        "asr": _asr_stage,
        "tts": _tts_stage,
        "vad": _vad_stage,
    }
    if config.stages.llm.backend == "local":
        loaders["llm"] = _llm_stage
    if config.stages.turn.model is not None:
        loaders["turn"] = _turn_stage
    stages = {}
    for name, load in loaders.items():
        logger.info("loading the %s stage", name)
        stages[name] = load(config, progress)
    return stages


def _asr_stage(config: EngineConfig, progress: bool) -> Stage:
    from engine.stages.asr import AsrStage, load_transcriber

    asr = config.stages.asr
    path = prepare_model("asr", asr.model, progress=progress)
    return AsrStage(
        load_transcriber(path, beam_size=asr.beam_size),
        max_batch=asr.max_batch,
        max_partial_batch=asr.max_partial_batch,
    )


def _llm_stage(config: EngineConfig, progress: bool) -> Stage:
    from engine.llm.context import ContextLimits
    from engine.llm.stage import LlmStage

    llm = config.stages.llm
    # The config fills both in for the local backend.
    assert llm.model is not None and llm.context is not None
    limits = config.engine
    return LlmStage.from_path(
        prepare_model("llm", llm.model, progress=progress),
        max_running_sequences=limits.max_running_sequences,
        prefill_chunk_tokens=limits.prefill_chunk_tokens,
        prefill_slice_tokens=limits.prefill_slice_tokens,
        prompt_cache_bytes=limits.prompt_cache_bytes,
        context_limits=ContextLimits(**llm.context.model_dump()),
        call_threshold=llm.call_threshold,
    )


def _tts_stage(config: EngineConfig, progress: bool) -> Stage:
    from engine.stages.tts import TtsStage, open_voice

    tts = config.stages.tts
    voice = open_voice(prepare_model("tts", tts.model, progress=progress), tts.voice)
    return TtsStage(voice, max_batch=tts.max_batch)


def voice_table(
    config: EngineConfig, stages: dict[str, Stage]
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The voices the TTS stage speaks, its default first, and the OpenAI voice name each
    of its own voices speaks for (empty: every OpenAI name speaks with the default)."""
    voice = getattr(stages.get("tts"), "voice", None)
    if voice is not None and voice.names:
        return tuple(voice.names), dict(voice.openai_voices)
    return (config.stages.tts.voice_name,), {}


def _vad_stage(config: EngineConfig, progress: bool) -> Stage:
    from engine.stages.vad import SileroVad, VadStage

    return VadStage(SileroVad(prepare_model("vad", config.stages.vad.model, progress=progress)))


def _turn_stage(config: EngineConfig, progress: bool) -> Stage:
    from engine.stages.turn_end import TurnEndModel, TurnEndStage

    turn = config.stages.turn
    assert turn.model is not None  # load_stages asks only then
    model = TurnEndModel(prepare_model("turn", turn.model, progress=progress))
    return TurnEndStage(model, max_batch=turn.max_batch)


def warm_up(stages: dict[str, Stage]) -> None:
    """Run one tiny request through each model stage before the engine thread starts."""
    from engine.llm.stage import LlmInput
    from engine.runtime.request import SamplingParams
    from engine.stages.tts import TtsRequest, TtsStage

    if "asr" in stages:
        stages["asr"].add(WARMUP_ID, np.zeros(16000, np.float32))
        _drain(stages["asr"])
    if "llm" in stages:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        hello = [{"role": "user", "content": "Hello"}]
        stages["llm"].add(WARMUP_ID, LlmInput(messages=hello, sampling_params=params))
        _drain(stages["llm"])
    if "turn" in stages:
        stages["turn"].add(WARMUP_ID, np.zeros(16000, np.float32))
        _drain(stages["turn"])
    tts = stages.get("tts")
    if isinstance(tts, TtsStage):
        tts.add(WARMUP_ID, TtsRequest())
        tts.feed(WARMUP_ID, "Hello there.", True)
        _drain(tts)


def cache_system_prompt(stages: dict[str, Stage], system_prompt: str) -> None:
    """Prefill the configured system prompt once, so no new session pays for it."""
    from engine.llm.stage import LlmStage

    llm = stages.get("llm")
    if isinstance(llm, LlmStage):
        tokens = llm.cache_shared_prefix(system_prompt)
        logger.info("system prompt prefix cached: %d tokens", tokens)


def _drain(stage: Stage) -> None:
    for _ in range(WARMUP_MAX_STEPS):
        outs: list[StageOutput] = stage.step()
        for out in outs:
            if out.request_id == WARMUP_ID and out.finished:
                if out.error is not None:
                    raise RuntimeError(f"{stage.name} stage failed its warm-up: {out.error}")
                return
    stage.abort(WARMUP_ID)
    raise RuntimeError(f"{stage.name} stage did not finish its warm-up request")
