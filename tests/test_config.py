"""Engine profile loading: defaults, the shipped profiles, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig, load_config, parse_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_default_profile_loads_with_embedded_models() -> None:
    config = load_config(CONFIGS / "default.yaml")
    assert config.stages.llm.backend == "local"
    assert config.stages.llm.model is not None
    assert config.stages.llm.model.name == "smollm2-135m-instruct"
    assert config.stages.asr.model.name == "whisper-tiny.en"
    assert config.stages.asr.beam_size == 1  # greedy
    assert config.stages.tts.model.name == "piper-en_US-joe-medium"
    assert config.stages.vad.model.name == "silero-vad"
    assert config.stages.tts.voice == "joe"
    assert "sentence" in config.system_prompt
    assert config.stages.turn.model is not None
    assert config.stages.turn.model.name == "smart-turn-v3.2"
    # The gateway section is the gateway's to validate, and it does.
    from gateway.config import GatewayConfig

    turns = GatewayConfig.model_validate(config.gateway).turns
    assert turns.min_interruption_ms > 0 and turns.interruption_words_after_ms is not None


def test_remote_profile_loads() -> None:
    config = load_config(CONFIGS / "remote-llm.yaml")
    assert config.stages.llm.backend == "remote"
    assert config.stages.llm.remote is not None
    assert config.stages.llm.remote.base_url.startswith("http://127.0.0.1")
    assert config.stages.llm.model is None


def test_every_profile_in_configs_is_valid() -> None:
    profiles = sorted(CONFIGS.glob("*.yaml"))
    assert profiles
    for path in profiles:
        assert isinstance(load_config(path), EngineConfig)


def test_empty_mapping_gives_defaults() -> None:
    config = parse_config({})
    assert config == parse_config(None)
    assert config.stages.llm.sampling.max_tokens == 96
    assert config.engine.max_running_sequences == 8


def test_model_can_be_a_name_or_a_mapping() -> None:
    config = parse_config(
        {"stages": {"llm": {"model": {"name": "smollm2-135m-instruct", "precision": "fp32"}}}}
    )
    assert config.stages.llm.model is not None
    assert config.stages.llm.model.precision == "fp32"
    config = parse_config({"stages": {"asr": {"model": "whisper-tiny.en"}}})
    assert config.stages.asr.model.name == "whisper-tiny.en"


def test_unknown_key_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("stages:\n  llm:\n    sampling:\n      temprature: 0.5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert "stages.llm.sampling.temprature: unknown key" in message


def test_out_of_range_value_names_its_path() -> None:
    with pytest.raises(ConfigError, match=r"stages\.llm\.sampling\.top_p"):
        parse_config({"stages": {"llm": {"sampling": {"top_p": 1.5}}}})
    with pytest.raises(ConfigError, match=r"stages\.tts\.speed"):
        parse_config({"stages": {"tts": {"speed": 0}}})


def test_remote_backend_needs_remote_settings() -> None:
    with pytest.raises(ConfigError, match="needs a 'remote:' mapping"):
        parse_config({"stages": {"llm": {"backend": "remote"}}})
    with pytest.raises(ConfigError, match="only used with backend 'remote'"):
        parse_config({"stages": {"llm": {"remote": {"base_url": "http://x/v1", "model": "m"}}}})
    with pytest.raises(ConfigError, match="not used with backend 'remote'"):
        parse_config(
            {
                "stages": {
                    "llm": {
                        "backend": "remote",
                        "model": "smollm2-135m-instruct",
                        "remote": {"base_url": "http://x/v1", "model": "m"},
                    }
                }
            }
        )

    remote = {"backend": "remote", "remote": {"base_url": "http://x/v1", "model": "m"}}
    with pytest.raises(ConfigError, match="'call_threshold' is the local model's"):
        parse_config({"stages": {"llm": {**remote, "call_threshold": 0.05}}})
    with pytest.raises(ConfigError, match=r"stages\.llm\.call_threshold"):
        parse_config({"stages": {"llm": {"call_threshold": 1.5}}})


def test_remote_url_must_be_http() -> None:
    with pytest.raises(ConfigError, match=r"stages\.llm\.remote\.base_url"):
        parse_config(
            {"stages": {"llm": {"backend": "remote", "remote": {"base_url": "x", "model": "m"}}}}
        )


def test_converter_needs_a_source() -> None:
    with pytest.raises(ConfigError, match="only used together with 'source'"):
        parse_config({"stages": {"asr": {"model": {"name": "x", "converter": "a:b"}}}})


def test_clause_limits_must_be_ordered() -> None:
    with pytest.raises(ConfigError, match="must not exceed max_chars"):
        parse_config({"clauses": {"min_chars": 100, "max_chars": 50}})
    with pytest.raises(ConfigError, match="must not exceed max_chars"):
        parse_config({"clauses": {"first_min_chars": 30, "first_max_chars": 20}})


def test_bad_yaml_and_missing_file_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("stages: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_config(["a", "list"])


def test_gateway_section_is_kept_for_the_gateway() -> None:
    config = parse_config({"gateway": {"port": 8000}})
    assert config.gateway == {"port": 8000}


# ---- from profile to models (engine.build) ----------------------------------------


def test_a_model_must_belong_to_its_stage() -> None:
    from engine.build import prepare_model
    from engine.config import ModelRef

    with pytest.raises(ValueError, match="is a llm model, not a asr model"):
        prepare_model("asr", ModelRef(name="smollm2-135m-instruct"), progress=False)


def test_a_model_with_a_source_is_registered_and_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.build import prepare_model
    from engine.config import ModelRef
    from engine.weights.registry import get_spec

    monkeypatch.setenv("DUPLEX_GATEWAY_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "weights"
    source.mkdir()
    (source / "model.bin").write_bytes(b"weights")
    ref = ModelRef(name="test-local-voice", source=f"path:{source}")
    out = prepare_model("tts", ref, progress=False)
    assert (out / "model.bin").read_bytes() == b"weights"
    assert out.parent == tmp_path / "cache"
    assert get_spec("test-local-voice").stage == "tts"


def test_remote_backend_loads_no_local_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import build

    loaded: list[str] = []
    for name in ("_asr_stage", "_tts_stage", "_vad_stage", "_llm_stage", "_turn_stage"):
        monkeypatch.setattr(build, name, lambda config, progress, n=name: loaded.append(n))
    build.load_stages(load_config(CONFIGS / "remote-llm.yaml"), progress=False)
    assert sorted(loaded) == ["_asr_stage", "_tts_stage", "_turn_stage", "_vad_stage"]
    loaded.clear()
    build.load_stages(load_config(CONFIGS / "default.yaml"), progress=False)
    assert sorted(loaded) == ["_asr_stage", "_llm_stage", "_tts_stage", "_turn_stage", "_vad_stage"]


def test_warm_up_reports_a_stage_that_never_finishes() -> None:
    from engine.build import _drain
    from engine.runtime.stage import StageOutput

    class Stuck:
        name = "stuck"
        aborted: list[str] = []

        def step(self) -> list[StageOutput]:
            return []

        def abort(self, request_id: str) -> None:
            self.aborted.append(request_id)

    stage = Stuck()
    with pytest.raises(RuntimeError, match="did not finish its warm-up"):
        _drain(stage)  # type: ignore[arg-type]
    assert stage.aborted == ["warmup"]


def test_a_beam_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="beam_size"):
        parse_config({"stages": {"asr": {"beam_size": 0}}})
